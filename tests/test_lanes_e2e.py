"""Lanes end to end, through the CLI and real workers: an upload does not wait behind a
bulk backlog, and a bulk photo keeps its lane through retries, dead letters, replays,
the sweep and crash recovery. The workers' own feeder feeds the bulk lane; tests/feeding.py
only sets the scene where no worker runs (what the feeder would have fed)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pyvips

from tests.conftest import PHOTOS, Env
from tests.feeding import bulk_stream, feed_bulk
from tests.test_recovery import HEIC, kill_mid_photo, state, wait_for

BULK_PHOTOS = sorted(PHOTOS.glob("Landscape_*.jpg"))


def ingest(env: Env, paths: list[Path], *options: str) -> list[uuid.UUID]:
    out = env.cli("ingest", *options, *map(str, paths)).stdout.split()
    return [uuid.UUID(line) for line in out]


def lane_of(env: Env, photo_id: uuid.UUID) -> dict[str, object]:
    return env.query("SELECT lane, tenant, enqueued_at, cost FROM photos WHERE id = $1",
                     photo_id)[0]  # fmt: skip


def break_original(env: Env, photo_id: uuid.UUID) -> tuple[Path, bytes]:
    original = next((env.tmp / "var/storage/originals" / str(photo_id)).iterdir())
    good = original.read_bytes()
    original.write_bytes(b"not an image at all")
    return original, good


def test_ingest_records_lane_tenant_and_cost_and_leaves_bulk_to_the_feeder(
    file_env: Env,
) -> None:
    """A bulk photo gets its row (cost from the header) and nothing in Redis; an
    interactive one is XADDed at once and counts as enqueued."""
    [bulk] = ingest(file_env, [PHOTOS / "4.webp"], "--lane", "bulk", "--tenant", "acme")
    [mine] = ingest(file_env, [PHOTOS / "4.webp"])
    row = lane_of(file_env, bulk)
    assert (row["lane"], row["tenant"], row["enqueued_at"]) == ("bulk", "acme", None)
    assert row["cost"] == 1024 * 772, "width × height from the header"
    assert lane_of(file_env, mine)["enqueued_at"] is not None
    assert file_env.redis.xlen(file_env.stream) == 1
    assert file_env.redis.exists(bulk_stream(file_env)) == 0 or not file_env.redis.xlen(
        bulk_stream(file_env)
    )


def test_an_upload_does_not_wait_behind_a_bulk_backlog(file_env: Env) -> None:
    """One render slot busy with a library import: an upload is rendered on the reserved
    slot, so only what was already in flight finishes while it waits. Counted in photos
    rather than seconds, so a busy machine slows both sides alike."""
    settings = {"DARKROOM_CONCURRENCY": "1"}
    for _ in range(3):  # a backlog that outlasts the upload's own ingest on a slow machine
        ingest(file_env, BULK_PHOTOS, "--lane", "bulk", "--tenant", "library")
    worker = file_env.start("run", **settings)
    wait_for(file_env, "SELECT 1 FROM photo_jobs WHERE state = 'active'", proc=worker)
    [upload] = ingest(file_env, [PHOTOS / "4.webp"])
    done = "SELECT 1 FROM photos WHERE id = $1 AND processing_state = 'processed'"
    wait_for(file_env, done, upload, proc=worker)
    worker.terminate()
    worker.communicate()
    [row] = file_env.query(
        "SELECT count(*) FILTER (WHERE b.processed_at BETWEEN u.enqueued_at AND u.processed_at)"
        " AS overtook, count(*) FILTER (WHERE b.processed_at IS NULL"
        " OR b.processed_at > u.processed_at) AS left"
        " FROM photos u, photos b WHERE u.id = $1 AND b.lane = 'bulk'",
        upload,
    )
    assert row["left"] > 0, "the backlog ran out before the upload arrived: nothing to show"
    assert row["overtook"] <= 2, f"{row['overtook']} bulk photos finished while the upload waited"


def test_a_bulk_photo_is_retried_dead_lettered_and_replayed_in_its_lane(file_env: Env) -> None:
    """Its retry backs off in the bulk stream, its dead letter names lane and tenant, and
    a replay hands it back to the feeder: the interactive stream never sees it."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"], "--lane", "bulk", "--tenant", "acme")
    original = next((file_env.tmp / "var/storage/originals" / str(photo_id)).iterdir())
    good = original.read_bytes()
    original.unlink()
    original.mkdir()  # reading a directory is an I/O error: retried, then dead-lettered
    settings = {"DARKROOM_MAX_ATTEMPTS": "2", "DARKROOM_RETRY_BASE_MS": "200",
                "DARKROOM_CLAIM_IDLE_MS": "1000"}  # fmt: skip
    log = file_env.cli("run", "--drain", **settings).stderr
    assert log.count('"attempt failed; will retry"') == 1
    [(_, letter)] = file_env.redis.xrange(file_env.dead)
    assert (letter["lane"], letter["tenant"], letter["attempts"]) == ("bulk", "acme", "2")
    assert file_env.redis.xlen(bulk_stream(file_env)) == 0
    assert file_env.redis.xlen(file_env.stream) == 0
    original.rmdir()
    original.write_bytes(good)
    assert file_env.cli("dlq", "replay").stdout.split()[-1] == "feeder"
    assert file_env.redis.xlen(file_env.dead) == 0 and file_env.redis.xlen(file_env.stream) == 0
    assert lane_of(file_env, photo_id)["enqueued_at"] is None
    file_env.cli("run", "--drain")  # its feeder feeds the photo again
    assert state(file_env, photo_id)[:2] == ("processed", "published")
    rows = file_env.query("SELECT lane, outcome FROM photo_attempts WHERE photo_id = $1",
                          photo_id)  # fmt: skip
    assert len(rows) == 3 and {r["lane"] for r in rows} == {"bulk"}, rows


def test_retry_of_a_failed_bulk_photo_goes_back_to_the_feeder(file_env: Env) -> None:
    """`darkroom retry` keeps the photo's lane: no XADD, the feeder's again."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"], "--lane", "bulk")
    original, good = break_original(file_env, photo_id)
    file_env.cli("run", "--drain")
    original.write_bytes(good)
    assert file_env.cli("retry", str(photo_id)).stdout.split()[-1] == "feeder"
    assert file_env.redis.xlen(file_env.stream) == 0
    assert lane_of(file_env, photo_id)["enqueued_at"] is None


def test_a_bulk_photo_the_feeder_does_not_take_is_reported_and_its_letter_kept(
    file_env: Env,
) -> None:
    """`enqueue` of a processed or missing bulk photo feeds nothing, says so and exits 1;
    `dlq replay` keeps a bulk letter whose photo is gone or processed since, and says why."""
    [done] = ingest(file_env, [PHOTOS / "4.webp"], "--lane", "bulk")
    file_env.cli("run", "--drain")
    fed_at, gone = lane_of(file_env, done)["enqueued_at"], uuid.uuid4()
    for args in ((str(done),), ("--lane", "bulk", str(gone))):
        result = file_env.cli("enqueue", *args, check=False)
        assert (result.returncode, result.stdout) == (1, ""), result
        assert "not handed to the feeder" in result.stderr
    assert lane_of(file_env, done)["enqueued_at"] == fed_at, "still counts as fed"
    for photo_id in (done, gone):
        letter = {"photo_id": str(photo_id), "lane": "bulk", "error_code": "corrupt_image"}
        file_env.redis.xadd(file_env.dead, letter)
    replay = file_env.cli("dlq", "replay")
    assert replay.stdout.count("skipped: its photo is gone, processed, or sent back already") == 2
    assert "2 skipped" in replay.stderr
    assert file_env.redis.xlen(file_env.dead) == 2, "the letters stay"
    assert file_env.redis.xlen(bulk_stream(file_env)) == 0
    assert lane_of(file_env, done)["enqueued_at"] == fed_at


def test_a_refused_enqueue_changes_nothing(file_env: Env) -> None:
    """`enqueue --lane bulk --tenant` of a failed photo exits 1 and leaves its lane,
    tenant, state and enqueue time as they were."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "acme")
    break_original(file_env, photo_id)
    file_env.cli("run", "--drain")
    before = lane_of(file_env, photo_id)
    refused = file_env.cli("enqueue", "--lane", "bulk", "--tenant", "t9", str(photo_id),
                           check=False)  # fmt: skip
    assert (refused.returncode, refused.stdout) == (1, ""), refused
    assert lane_of(file_env, photo_id) == before
    assert state(file_env, photo_id)[0] == "processing_failed"


def test_enqueue_moves_a_photo_between_lanes(file_env: Env) -> None:
    """`enqueue --lane bulk` hands a photo to the feeder; `--lane interactive` XADDs it."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"])
    assert (
        file_env.cli("enqueue", "--lane", "bulk", "--tenant", "t1", str(photo_id)).stdout.strip()
        == "feeder"
    )
    row = lane_of(file_env, photo_id)
    assert (row["lane"], row["tenant"], row["enqueued_at"]) == ("bulk", "t1", None)
    entry_id = file_env.cli("enqueue", "--lane", "interactive", str(photo_id)).stdout.strip()
    assert file_env.redis.xrange(file_env.stream, entry_id, entry_id)
    assert lane_of(file_env, photo_id)["lane"] == "interactive"


def test_a_bulk_photo_lost_by_redis_is_swept_back_to_the_feeder(file_env: Env) -> None:
    """The bulk stream vanishes: the sweep hands the photo to the feeder, not to the
    interactive stream, and a photo the feeder has not fed yet is not lost."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"], "--lane", "bulk")
    feed_bulk(file_env)
    file_env.redis.delete(bulk_stream(file_env))
    time.sleep(1.2)
    stderr = file_env.cli("run", "--drain", DARKROOM_SWEEP_AFTER_S="1").stderr
    assert "swept lost photos back into the stream" in stderr
    assert state(file_env, photo_id)[:2] == ("processed", "published"), "fed again"
    assert lane_of(file_env, photo_id)["lane"] == "bulk"
    assert file_env.redis.xlen(file_env.stream) == 0, "never through the interactive stream"


def test_a_killed_worker_s_bulk_entry_is_recovered_from_the_bulk_stream(file_env: Env) -> None:
    """SIGKILL mid-photo: the bulk entry is reclaimed from its own stream and published."""
    settings = {"DARKROOM_CLAIM_IDLE_MS": "1500"}
    [photo_id] = ingest(file_env, [HEIC], "--lane", "bulk")
    kill_mid_photo(file_env, settings)
    file_env.cli("run", "--drain", **settings)
    assert state(file_env, photo_id) == ("processed", "published", 2)
    assert file_env.redis.xlen(bulk_stream(file_env)) == 0
    assert file_env.redis.xlen(file_env.stream) == 0


def test_status_and_photos_show_each_lane(file_env: Env) -> None:
    """`status --json` gives each lane's backlog, lag and oldest wait; `photos` its lane."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"], "--lane", "bulk", "--tenant", "acme")
    feed_bulk(file_env)
    report = json.loads(file_env.cli("status", "--json").stdout)
    bulk = report["lanes"]["bulk"]
    assert (bulk["length"], bulk["pending"], report["lanes"]["interactive"]["length"]) == (1, 0, 0)
    assert bulk["oldest_wait_s"] is not None and bulk["oldest_wait_s"] >= 0
    line = next(x for x in file_env.cli("photos").stdout.splitlines() if str(photo_id) in x)
    assert "bulk" in line.split() and "acme" in line.split()


def test_a_library_re_render_goes_through_bulk_unless_told_otherwise(file_env: Env) -> None:
    """`enqueue --rerender --since` hands every photo to the feeder (bulk); named photos
    keep their lane; `--lane interactive` XADDs them."""
    [photo_id] = ingest(file_env, [PHOTOS / "4.webp"])
    file_env.cli("run", "--drain")
    since = ("enqueue", "--rerender", "--state", "processed", "--since", "2000-01-01")
    assert file_env.cli(*since).stdout.split() == [str(photo_id), "feeder"]
    row = lane_of(file_env, photo_id)
    assert (row["lane"], row["enqueued_at"]) == ("bulk", None)
    assert file_env.redis.xlen(file_env.stream) == 0
    file_env.cli("run", "--drain")  # its feeder feeds the re-render
    done = file_env.query("SELECT rerender_requested_at FROM photos WHERE id = $1", photo_id)
    assert done[0]["rerender_requested_at"] is None, "re-rendered through the bulk lane"
    out = file_env.cli(*since, "--lane", "interactive").stdout.split()
    assert out[0] == str(photo_id) and out[1] != "feeder"
    assert lane_of(file_env, photo_id)["lane"] == "interactive"


def test_a_drain_ends_only_once_every_bulk_entry_it_fed_is_done(file_env: Env) -> None:
    """40 bulk photos, one render slot: `run --drain` exits 0 with all 40 processed and
    nothing left unread in the bulk stream."""
    tiny = file_env.tmp / "tiny.png"
    (pyvips.Image.black(64, 48, bands=3) + 128).pngsave(str(tiny))
    ids = ingest(file_env, [tiny] * 40, "--lane", "bulk", "--tenant", "library")
    file_env.cli("run", "--drain", DARKROOM_CONCURRENCY="1")
    left = file_env.query("SELECT count(*) AS n FROM photos WHERE id = ANY($1::uuid[])"
                          " AND processing_state <> 'processed'", ids)[0]["n"]  # fmt: skip
    assert (left, file_env.redis.xlen(bulk_stream(file_env))) == (0, 0)
