"""Crash recovery, heartbeat, sweeper, duplicates, isolation and the second signal —
each against the real servers, through the real CLI."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime
from typing import Any

from tests.chaos.rig import Proxy
from tests.conftest import PHOTOS, Env, free_port

HEIC = PHOTOS / "iphone_13_pro_max.HEIC"  # the slowest sample: about a second to render


def log_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def wait_for(env: Env, sql: str, *args: Any, proc: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + 60
    while not env.query(sql, *args):
        assert time.monotonic() < deadline, f"timed out waiting for: {sql}"
        assert proc is None or proc.poll() is None, proc.communicate()[1] if proc else ""
        time.sleep(0.01)


def readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def kill_mid_photo(env: Env, settings: dict[str, str]) -> None:
    """Start a worker, SIGKILL it as soon as it has claimed a photo."""
    worker = env.start("run", **settings)
    wait_for(env, "SELECT 1 FROM photo_jobs WHERE state = 'active'", proc=worker)
    worker.kill()
    worker.communicate()


def state(env: Env, photo_id: uuid.UUID) -> tuple[str, str, int]:
    row = env.query(
        "SELECT p.processing_state, p.visibility, j.attempt FROM photos p"
        " JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = $1",
        photo_id,
    )[0]
    return row["processing_state"], row["visibility"], row["attempt"]


def test_retry_waits_for_its_backoff(file_env: Env) -> None:
    """Each retry starts no sooner than the backoff it was given; next_retry_at is recorded."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    original = next((file_env.tmp / "var/storage/originals" / str(photo_id)).iterdir())
    original.unlink()
    original.mkdir()  # an I/O error on this one photo: storage itself answers
    stderr = file_env.cli(
        "run", "--drain", DARKROOM_MAX_ATTEMPTS="4", DARKROOM_RETRY_BASE_MS="400",
        DARKROOM_CLAIM_IDLE_MS="5000",
    ).stderr  # fmt: skip
    failures = [e for e in log_lines(stderr) if e["event"] == "attempt failed; will retry"]
    failures += [e for e in log_lines(stderr) if e["event"] == "photo failed; dead-lettered"]
    assert [e["attempt"] for e in failures] == [1, 2, 3, 4]
    for before, after in itertools.pairwise(failures):
        gap_s = (
            datetime.fromisoformat(after["timestamp"]) - datetime.fromisoformat(before["timestamp"])
        ).total_seconds()
        assert gap_s >= before["delay_ms"] / 1000, (before, after)
    assert [e["delay_ms"] for e in failures[:3]] == sorted(e["delay_ms"] for e in failures[:3])


def test_killed_worker_is_recovered_within_the_claim_idle_time(file_env: Env) -> None:
    """SIGKILL mid-photo: another worker takes the entry over after CLAIM_IDLE_MS and publishes."""
    settings = {"DARKROOM_CLAIM_IDLE_MS": "1500"}
    [photo_id] = file_env.ingest([HEIC])
    kill_mid_photo(file_env, settings)
    killed_at = time.monotonic()
    file_env.cli("run", "--drain", **settings)
    # the claim idle time, not the sweep (DARKROOM_SWEEP_AFTER_S, 300 s): a loaded machine may
    # stretch the render itself, so the bound is loose
    assert time.monotonic() - killed_at < 60, "recovered by the reclaim, not by the sweep"
    assert state(file_env, photo_id) == ("processed", "published", 2)


def test_heartbeat_keeps_a_slow_photo_from_being_stolen(file_env: Env) -> None:
    """Photos held longer than CLAIM_IDLE_MS (one render slot: the second waits about a
    second for it, then renders for about a second) stay with their live worker:
    delivered once, done once."""
    settings = {"DARKROOM_CLAIM_IDLE_MS": "1000", "DARKROOM_CONCURRENCY": "1"}
    photo_ids = file_env.ingest([HEIC, HEIC])
    owner = file_env.start("run", **settings)
    wait_for(file_env, "SELECT 1 FROM photo_jobs WHERE state = 'active'", proc=owner)
    thief = file_env.start("run", **settings)
    processed = (
        "SELECT 1 FROM photos HAVING count(*) FILTER (WHERE processing_state = 'processed') = 2"
    )
    wait_for(file_env, processed, proc=owner)
    time.sleep(1)
    for proc in (owner, thief):
        proc.send_signal(signal.SIGTERM)
    owner_log, thief_log = (log_lines(p.communicate(timeout=60)[1]) for p in (owner, thief))
    assert [e["outcome"] for e in owner_log if e["event"] == "entry done"] == ["published"] * 2
    assert [e for e in thief_log if e["event"] == "entry done"] == []
    assert [state(file_env, i) for i in photo_ids] == [("processed", "published", 1)] * 2


def test_sweeper_re_enqueues_photos_redis_lost(file_env: Env) -> None:
    """The stream vanishes (a Redis restart without persistence): Postgres re-enqueues all."""
    ids = file_env.ingest(
        [PHOTOS / "4.webp", PHOTOS / "Landscape_2.jpg", PHOTOS / "animated-loop-3.gif"]
    )
    file_env.redis.delete(file_env.stream)
    time.sleep(1.2)
    stderr = file_env.cli("run", "--drain", DARKROOM_SWEEP_AFTER_S="1").stderr
    assert "swept lost photos back into the stream" in stderr
    assert {state(file_env, i)[:2] for i in ids} == {("processed", "published")}


def test_producer_crash_before_xadd_is_covered(file_env: Env) -> None:
    """A row committed without its XADD is found by the sweep once it is stale."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    file_env.redis.xtrim(file_env.stream, maxlen=0)
    file_env.cli("run", "--drain", DARKROOM_SWEEP_AFTER_S="30")
    assert (
        file_env.query("SELECT processing_state FROM photos")[0]["processing_state"] == "uploaded"
    )
    file_env.query("UPDATE photos SET last_activity_at = now() - interval '1 minute'")
    file_env.cli("run", "--drain", DARKROOM_SWEEP_AFTER_S="30")
    assert state(file_env, photo_id)[:2] == ("processed", "published")


def test_entry_deleted_while_pending_is_re_enqueued(file_env: Env) -> None:
    """XAUTOCLAIM reports a pending entry whose data was deleted; its photo is enqueued again."""
    settings = {"DARKROOM_CLAIM_IDLE_MS": "1000"}
    [photo_id] = file_env.ingest([HEIC])
    kill_mid_photo(file_env, settings)
    [(entry_id, _)] = file_env.redis.xrange(file_env.stream)
    file_env.redis.xdel(file_env.stream, entry_id)
    stderr = file_env.cli("run", "--drain", **settings).stderr
    assert "pending entries were deleted; photos re-enqueued" in stderr
    assert state(file_env, photo_id)[:2] == ("processed", "published")


def test_duplicate_deliveries_publish_once(file_env: Env) -> None:
    """The same photo enqueued three times: one publish, the rest `already`, processed_at kept."""
    [photo_id] = file_env.ingest([PHOTOS / "Landscape_4.jpg"])
    file_env.cli("enqueue", str(photo_id), str(photo_id))
    outcomes = [e["outcome"] for e in log_lines(file_env.cli("run", "--drain").stderr)
                if e["event"] == "entry done"]  # fmt: skip
    assert sorted(outcomes) == ["already", "already", "published"]
    first = file_env.query("SELECT processed_at FROM photos")[0]["processed_at"]
    file_env.cli("enqueue", str(photo_id))
    file_env.cli("run", "--drain")
    assert file_env.query("SELECT processed_at FROM photos")[0]["processed_at"] == first


def test_render_over_its_memory_limit_fails_only_that_photo(file_env: Env) -> None:
    """A render past DARKROOM_RENDER_MEMORY_MB (killed or crashing in native code) is retried,
    then dead-lettered alone; the worker and the other photos carry on."""
    heic, small = file_env.ingest([HEIC, PHOTOS / "animated-loop-3.gif"])
    file_env.cli("run", "--drain", DARKROOM_RENDER_MEMORY_MB="200", DARKROOM_MAX_ATTEMPTS="2",
                 DARKROOM_RETRY_BASE_MS="100")  # fmt: skip
    code = file_env.query("SELECT error_code FROM photos WHERE id = $1", heic)[0]["error_code"]
    assert code in ("out_of_memory", "render_crashed")
    [(_, letter)] = file_env.redis.xrange(file_env.dead)
    assert (letter["photo_id"], letter["attempts"], letter["stage"]) == (str(heic), "2", "render")
    assert state(file_env, small)[:2] == ("processed", "published")


def test_render_past_the_time_limit_is_a_timeout(file_env: Env) -> None:
    """A render slower than DARKROOM_JOB_TIMEOUT_S is killed and fails with code timeout."""
    [photo_id] = file_env.ingest([HEIC])
    file_env.cli("run", "--drain", DARKROOM_JOB_TIMEOUT_S="0.1", DARKROOM_MAX_ATTEMPTS="2",
                 DARKROOM_RETRY_BASE_MS="100")  # fmt: skip
    row = file_env.query("SELECT error_code FROM photos WHERE id = $1", photo_id)[0]
    assert row["error_code"] == "timeout"
    assert [f["attempts"] for _, f in file_env.redis.xrange(file_env.dead)] == ["2"]


def test_second_signal_exits_at_once_leaving_entries_pending(file_env: Env) -> None:
    """SIGTERM then SIGINT: exit 130 without waiting; the unfinished entry stays pending."""
    [photo_id] = file_env.ingest([HEIC])
    worker = file_env.start("run", DARKROOM_SHUTDOWN_GRACE_S="60")
    wait_for(file_env, "SELECT 1 FROM photo_jobs WHERE state = 'active'", proc=worker)
    worker.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    worker.send_signal(signal.SIGINT)
    worker.communicate(timeout=10)
    assert worker.returncode == 130
    assert file_env.redis.xpending(file_env.stream, "darkroom")["pending"] == 1
    assert state(file_env, photo_id)[:2] == ("processing", "unpublished")


def test_storage_outage_burns_no_attempt(s3_env: Env) -> None:
    """S3 unreachable: the worker pauses and waits; when S3 is back every photo is published
    on its first delivery, with no retry recorded."""
    ids = s3_env.ingest([PHOTOS / "4.webp", PHOTOS / "Landscape_5.jpg"])
    endpoint = s3_env.vars["DARKROOM_S3_ENDPOINT_URL"]
    proxy = Proxy("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
    port = free_port()
    try:
        proxy.refuse(True)
        worker = s3_env.start(
            "run",
            DARKROOM_S3_ENDPOINT_URL=f"http://{proxy.url_host}",
            DARKROOM_METRICS_PORT=str(port),
        )
        # botocore retries on its own first; once they are spent, the gate closes (/readyz 503)
        deadline = time.monotonic() + 120  # 3 botocore attempts of up to 30 s each
        while readyz(port) != 503:
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.1)
        assert s3_env.query("SELECT 1 FROM photos WHERE processing_state = 'processed'") == []
        proxy.refuse(False)
        wait_for(s3_env, "SELECT 1 FROM photos HAVING count(*) FILTER "
                 "(WHERE processing_state = 'processed') = 2", proc=worker)  # fmt: skip
        worker.send_signal(signal.SIGTERM)
        stderr = worker.communicate(timeout=60)[1]
    finally:
        proxy.close()
    events = [e["event"] for e in log_lines(stderr)]
    assert "dependency down: pausing intake" in events, stderr
    assert "dependency back: resuming" in events, stderr
    assert "attempt failed; will retry" not in events, stderr
    assert {state(s3_env, i) for i in ids} == {("processed", "published", 1)}, stderr


def test_database_outage_burns_no_attempt(file_env: Env) -> None:
    """PostgreSQL unreachable, even at start-up: the worker keeps running and catches up."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    proxy = Proxy("127.0.0.1", 5432)
    port = free_port()
    try:
        proxy.refuse(True)
        url = f"postgresql://postgres@{proxy.url_host}/{file_env.database_url.rsplit('/', 1)[1]}"
        worker = file_env.start("run", DARKROOM_DATABASE_URL=url, DARKROOM_METRICS_PORT=str(port))
        # until the worker has met the outage (a fixed sleep can end first on a busy machine)
        deadline = time.monotonic() + 60
        while readyz(port) != 503:
            assert time.monotonic() < deadline, "/readyz never said the database was down"
            assert worker.poll() is None, "a database outage does not end the worker"
            time.sleep(0.1)
        proxy.refuse(False)
        wait_for(file_env, "SELECT 1 FROM photos WHERE processing_state = 'processed'", proc=worker)
        worker.send_signal(signal.SIGTERM)
        events = [e["event"] for e in log_lines(worker.communicate(timeout=60)[1])]
    finally:
        proxy.close()
    assert "dependency down: pausing intake" in events
    assert "attempt failed; will retry" not in events
    assert state(file_env, photo_id) == ("processed", "published", 1)


def test_redis_outage_pauses_and_resumes_without_burning_attempts(file_env: Env) -> None:
    """Redis unreachable mid-batch: the worker keeps running, reconnects, finishes every photo
    on its first delivery and acks them all."""
    ids = file_env.ingest(sorted(PHOTOS.glob("Landscape_*.jpg"))[:6])
    proxy = Proxy("127.0.0.1", 6379)
    port = free_port()
    try:
        worker = file_env.start(
            "run", DARKROOM_REDIS_URL=f"redis://{proxy.url_host}/0", DARKROOM_METRICS_PORT=str(port)
        )
        wait_for(file_env, "SELECT 1 FROM photos WHERE processing_state = 'processed'", proc=worker)
        proxy.refuse(True)
        deadline = time.monotonic() + 60
        while readyz(port) != 503:  # the gate has closed: the worker noticed the outage
            assert time.monotonic() < deadline, "a Redis outage does not end the worker"
            assert worker.poll() is None, "a Redis outage does not end the worker"
            time.sleep(0.1)
        time.sleep(1)
        proxy.refuse(False)
        wait_for(file_env, "SELECT 1 FROM photos HAVING bool_and(processing_state = 'processed')",
                 proc=worker)  # fmt: skip
        deadline = time.monotonic() + 30
        while file_env.redis.xlen(file_env.stream):
            assert time.monotonic() < deadline, "every entry is acked once Redis is back"
            time.sleep(0.05)
        worker.send_signal(signal.SIGTERM)
        stderr = worker.communicate(timeout=60)[1]
    finally:
        proxy.close()
    events = [e["event"] for e in log_lines(stderr)]
    assert worker.returncode == 0, stderr
    assert "dependency down: pausing intake" in events, stderr
    assert "dependency back: resuming" in events, stderr
    assert "attempt failed; will retry" not in events, stderr
    assert {state(file_env, i) for i in ids} == {("processed", "published", 1)}
    assert file_env.redis.xpending(file_env.stream, "darkroom")["pending"] == 0


def test_sigterm_during_a_redis_outage_still_exits_promptly(file_env: Env) -> None:
    """A stop request is honoured while the worker waits for Redis to come back."""
    proxy = Proxy("127.0.0.1", 6379)
    try:
        worker = file_env.start(
            "run", DARKROOM_REDIS_URL=f"redis://{proxy.url_host}/0", DARKROOM_SHUTDOWN_GRACE_S="2"
        )
        time.sleep(1.5)
        proxy.refuse(True)
        time.sleep(2)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=15)
    finally:
        proxy.close()
    assert worker.returncode == 0, stderr
    assert "dependency down: pausing intake" in stderr
