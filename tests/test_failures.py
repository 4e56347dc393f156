"""Failures end in a stable error code, in Postgres and in the dead-letter stream; none is lost."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import redis.asyncio

from darkroom.queue.streams import Streams
from tests.conftest import PHOTOS, REDIS_URL, Env


def dead_letters(env: Env) -> list[dict[str, str]]:
    return [fields for _, fields in env.redis.xrange(env.dead)]


def photo_and_job(env: Env, photo_id: uuid.UUID) -> tuple[dict[str, object], dict[str, object]]:
    photo = env.query("SELECT * FROM photos WHERE id = $1", photo_id)[0]
    job = env.query("SELECT * FROM photo_jobs WHERE photo_id = $1", photo_id)[0]
    return photo, job


def assert_failed(env: Env, photo_id: uuid.UUID, code: str, attempts: int) -> dict[str, str]:
    """Photo processing_failed + unpublished, job failed, one dead letter, stream empty."""
    photo, job = photo_and_job(env, photo_id)
    assert (photo["processing_state"], photo["visibility"], photo["error_code"]) == (
        "processing_failed", "unpublished", code)  # fmt: skip
    assert photo["renditions"] is None and photo["processed_at"] is None
    assert (job["state"], job["error_code"]) == ("failed", code)
    assert job["last_error"]
    [letter] = dead_letters(env)
    assert letter["photo_id"] == str(photo_id) and letter["error_code"] == code
    assert int(letter["attempts"]) == attempts
    assert {"source_id", "error", "stage", "consumer", "failed_at"} <= letter.keys()
    assert env.redis.xlen(env.stream) == 0
    assert env.redis.xpending(env.stream, "darkroom")["pending"] == 0
    return letter


def test_corrupt_image_is_dead_lettered_at_once(file_env: Env, tmp_path: Path) -> None:
    """A truncated JPEG fails on its first attempt as corrupt_image, without retries."""
    broken = tmp_path / "broken.jpg"
    broken.write_bytes((PHOTOS / "Landscape_1.jpg").read_bytes()[:60_000])
    [photo_id] = file_env.ingest([broken])
    file_env.cli("run", "--drain")
    letter = assert_failed(file_env, photo_id, "corrupt_image", attempts=1)
    assert letter["stage"] == "render"
    assert not (file_env.tmp / "var" / "storage" / "renditions" / str(photo_id)).exists()


def test_not_an_image_is_unsupported_format(file_env: Env, tmp_path: Path) -> None:
    """A CSV renamed .jpg is refused by content (no libvips matrix/CSV loader runs)."""
    fake = tmp_path / "table.jpg"
    fake.write_text("1,2,3\n4,5,6\n")
    [photo_id] = file_env.ingest([fake])
    file_env.cli("run", "--drain")
    assert_failed(file_env, photo_id, "unsupported_format", attempts=1)


def test_missing_original_is_original_missing(file_env: Env) -> None:
    """An original deleted from storage before processing fails as original_missing."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    shutil.rmtree(file_env.tmp / "var" / "storage" / "originals" / str(photo_id))
    file_env.cli("run", "--drain")
    assert_failed(file_env, photo_id, "original_missing", attempts=1)


def test_malformed_entry_is_bad_message(file_env: Env) -> None:
    """An entry without a UUID photo_id goes to the dead-letter stream with its fields."""
    file_env.cli("enqueue", str(uuid.uuid4()))  # creates the group
    file_env.redis.xadd(file_env.stream, {"photo_id": "not-a-uuid", "trace": "abc"})
    file_env.cli("run", "--drain")
    [letter] = [d for d in dead_letters(file_env)]
    assert letter["error_code"] == "bad_message" and letter["orig_photo_id"] == "not-a-uuid"
    assert letter["trace"] == "abc" and letter["photo_id"] == ""
    assert file_env.redis.xlen(file_env.stream) == 0


def test_transient_failure_retries_with_backoff_then_dead_letters(file_env: Env) -> None:
    """A permanent storage error is retried, each attempt counted, and dead-lettered at the cap."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    original = next((file_env.tmp / "var" / "storage" / "originals" / str(photo_id)).iterdir())
    original.unlink()
    original.mkdir()  # reading a directory is an I/O error, not a missing object
    log = file_env.cli(
        "run", "--drain",
        DARKROOM_MAX_ATTEMPTS="3", DARKROOM_RETRY_BASE_MS="200", DARKROOM_CLAIM_IDLE_MS="1000",
    ).stderr  # fmt: skip
    assert log.count('"attempt failed; will retry"') == 2
    assert_failed(file_env, photo_id, "storage_unavailable", attempts=3)
    _, job = photo_and_job(file_env, photo_id)
    assert job["attempt"] == 3


def test_failed_photo_replayed_after_fix_is_published(file_env: Env) -> None:
    """A failed photo ignores duplicates; `darkroom retry` after the fix publishes it."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    folder = file_env.tmp / "var" / "storage" / "originals" / str(photo_id)
    original = next(folder.iterdir())
    good = original.read_bytes()
    original.write_bytes(good[:1000])
    file_env.cli("run", "--drain")
    assert_failed(file_env, photo_id, "corrupt_image", attempts=1)
    file_env.cli("enqueue", str(photo_id))
    log = file_env.cli("run", "--drain").stderr
    assert '"outcome": "already"' in log, "a failed photo is terminal: a duplicate changes nothing"
    assert photo_and_job(file_env, photo_id)[0]["processing_state"] == "processing_failed"
    original.write_bytes(good)
    file_env.cli("retry", str(photo_id))
    assert file_env.cli("retry", str(photo_id), check=False).returncode == 1
    file_env.cli("run", "--drain")
    photo, job = photo_and_job(file_env, photo_id)
    assert (photo["processing_state"], photo["visibility"], photo["error_code"]) == (
        "processed", "published", None)  # fmt: skip
    assert (job["state"], job["attempt"]) == ("done", 2)


def test_dead_letters_are_listed_and_replayed_once(file_env: Env) -> None:
    """`dlq list` shows the letter; the replay script re-enqueues it once, filters by code."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    original = next((file_env.tmp / "var" / "storage" / "originals" / str(photo_id)).iterdir())
    good = original.read_bytes()
    original.write_bytes(b"not an image at all")
    file_env.cli("run", "--drain")
    listed = file_env.cli("dlq", "list").stdout
    assert str(photo_id) in listed and "unsupported_format" in listed
    assert file_env.cli("dlq", "replay", "--code", "corrupt_image").stdout == ""
    assert "would replay" in file_env.cli("dlq", "replay", "--dry-run").stdout
    assert file_env.redis.xlen(file_env.dead) == 1
    original.write_bytes(good)
    script = Path(__file__).parents[1] / "scripts" / "replay-dead-letters"
    replay = subprocess.run([str(script)], env=file_env.environ(), capture_output=True, text=True)
    assert replay.returncode == 0 and "replayed as" in replay.stdout
    assert file_env.cli("dlq", "replay").stdout == "", "a second replay finds nothing"
    assert file_env.redis.xlen(file_env.dead) == 0 and file_env.redis.xlen(file_env.stream) == 1
    file_env.cli("run", "--drain")
    photo, _ = photo_and_job(file_env, photo_id)
    assert photo["processing_state"] == "processed"


def test_photo_that_kills_the_worker_every_time_is_dead_lettered(file_env: Env) -> None:
    """SIGKILL on every delivery: after MAX_ATTEMPTS deliveries it is dead-lettered, not looped."""
    settings = {"DARKROOM_MAX_ATTEMPTS": "2", "DARKROOM_CLAIM_IDLE_MS": "1000"}
    [photo_id] = file_env.ingest([PHOTOS / "iphone_13_pro_max.HEIC"])
    _kill_at_attempts(file_env, photo_id, (1, 2), settings)
    file_env.cli("run", "--drain", **settings)
    letter = assert_failed(file_env, photo_id, "attempts_exhausted", attempts=3)
    assert "none recorded (the worker died)" in letter["error"]


async def test_dead_letter_stream_is_bounded(file_env: Env) -> None:
    """The dead-letter stream is trimmed to about DARKROOM_DEAD_LETTER_MAXLEN entries."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, file_env.stream, "darkroom", "t", file_env.dead, dead_maxlen=10)
    try:
        await streams.ensure_group()
        for n in range(400):
            await streams.dead_letter(f"{n + 1}-0", {"photo_id": "", "n": str(n)})
        length = await client.xlen(file_env.dead)
        last = await client.xrevrange(file_env.dead, count=1)
    finally:
        await client.aclose()
    assert 10 <= length <= 110, "MAXLEN ~ trims by whole macro nodes (100 entries)"
    assert last[0][1]["n"] == "399", "the newest letters are kept"


def failed_with_a_letter(env: Env) -> tuple[uuid.UUID, str, dict[str, str]]:
    """A photo that failed for good: its id and its one dead letter (id, fields)."""
    bad = env.tmp / "bad.jpg"
    bad.write_text("not an image at all")
    [photo_id] = env.ingest([bad])
    env.cli("run", "--drain")
    [(letter_id, fields)] = env.redis.xrange(env.dead)
    return photo_id, letter_id, fields


async def test_a_dead_letter_call_sent_again_writes_one_letter(file_env: Env) -> None:
    """The reply to a dead letter is lost and the client sends the call again (the entry
    is acked and deleted by then): it gets the first letter's id, and one letter stays;
    replaying twice enqueues the photo once."""
    _, letter_id, fields = failed_with_a_letter(file_env)
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, file_env.stream, "darkroom", fields["consumer"], file_env.dead)
    try:
        assert await streams.dead_letter(fields["source_id"], fields) == letter_id
    finally:
        await client.aclose()
    assert file_env.redis.xlen(file_env.dead) == 1
    assert "replayed as" in file_env.cli("dlq", "replay").stdout
    assert file_env.cli("dlq", "replay").stdout == "", "a second replay finds nothing"
    assert file_env.redis.xlen(file_env.stream) == 1


def test_a_second_letter_of_a_photo_already_replayed_enqueues_nothing(file_env: Env) -> None:
    """Two letters name one failed photo (an older worker wrote one per resent call): the
    replay sends the photo back once and keeps the other letter, saying why."""
    photo_id, _, fields = failed_with_a_letter(file_env)
    file_env.redis.xadd(file_env.dead, fields)
    replay = file_env.cli("dlq", "replay")
    assert replay.stdout.count("replayed as") == 1, replay.stdout
    assert "skipped: its photo is gone, processed, or sent back already" in replay.stdout
    assert file_env.redis.xlen(file_env.stream) == 1 and file_env.redis.xlen(file_env.dead) == 1
    assert photo_and_job(file_env, photo_id)[0]["processing_state"] == "uploaded"


def test_rerender_that_kills_the_worker_every_time_fails_like_any_rerender(
    file_env: Env,
) -> None:
    """A re-render whose worker is SIGKILLed on every delivery ends at the cap as a failed
    re-render: the photo stays published with its renditions and its request, the job
    records attempts_exhausted and is no longer active (gc may collect its uploads), and
    a new `enqueue --rerender` gets a new run of attempts and publishes."""
    settings = {"DARKROOM_MAX_ATTEMPTS": "2", "DARKROOM_CLAIM_IDLE_MS": "1000"}
    [photo_id] = file_env.ingest([PHOTOS / "iphone_13_pro_max.HEIC"])
    file_env.cli("run", "--drain")
    [before] = file_env.query("SELECT renditions FROM photos WHERE id = $1", photo_id)
    file_env.cli("enqueue", "--rerender", str(photo_id))
    _kill_at_attempts(file_env, photo_id, (2, 3), settings)  # render 1 was attempt 1
    file_env.cli("run", "--drain", **settings)
    [row] = file_env.query(
        "SELECT p.processing_state, p.visibility, p.renditions, p.rerender_requested_at,"
        " j.state, j.error_code FROM photos p JOIN photo_jobs j ON j.photo_id = p.id"
        " WHERE p.id = $1",
        photo_id,
    )
    assert (row["processing_state"], row["visibility"]) == ("processed", "published")
    assert row["renditions"] == before["renditions"] and row["rerender_requested_at"] is None
    assert (row["state"], row["error_code"]) == ("failed", "attempts_exhausted")
    assert file_env.redis.xlen(file_env.stream) == 0 and file_env.redis.xlen(file_env.dead) == 0
    file_env.cli("enqueue", "--rerender", str(photo_id))
    file_env.cli("run", "--drain", **settings)
    [done] = file_env.query(
        "SELECT rerendered_at, rerender_requested_at FROM photos WHERE id = $1", photo_id
    )
    assert done["rerendered_at"] is not None and done["rerender_requested_at"] is None


def _kill_at_attempts(
    file_env: Env, photo_id: uuid.UUID, attempts: tuple[int, ...], settings: dict[str, str]
) -> None:
    """Start a worker and SIGKILL it as soon as its claim makes each of these attempts."""
    for attempt in attempts:
        worker = file_env.start("run", **settings)
        deadline = time.monotonic() + 60
        while not file_env.query(
            "SELECT 1 FROM photo_jobs WHERE photo_id = $1 AND attempt = $2", photo_id, attempt
        ):
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.01)
        worker.kill()
        worker.communicate()
