"""Transient is not failure, through the real CLI against the real servers: S3
throttling a prefix while the probe passes, a PostgreSQL connection killed mid-job and a
reclaim from a live owner after a Redis outage cost the photo no attempt; only a streak of
transient errors past DARKROOM_TRANSIENT_BUDGET_S fails it, with the dependency's code."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import pytest

from tests.chaos.rig import Proxy
from tests.conftest import PHOTOS, REDIS_URL, Env
from tests.faults import DenyingS3Proxy
from tests.test_recovery import log_lines, state, wait_for


def renditions_put(method: str, path: str) -> bool:
    return method == "PUT" and "/renditions/" in path and ".darkroom-probe" not in path


@pytest.fixture
def s3_proxy(s3_env: Env) -> Iterator[DenyingS3Proxy]:
    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    yield proxy
    proxy.close()


def until(condition: Callable[[], object], what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    proc.send_signal(signal.SIGTERM)
    return log_lines(proc.communicate(timeout=60)[1])


def events(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [x for x in lines if x["event"] == event]


def test_s3_slowdown_on_renditions_waits_in_place_and_publishes_on_attempt_1(
    s3_env: Env, s3_proxy: DenyingS3Proxy
) -> None:
    """503 SlowDown on every rendition upload while `.darkroom-probe` passes: the photo waits
    in place (no retry counted, no dead letter) and is published once the throttling ends,
    on its first attempt."""
    [photo_id] = s3_env.ingest([PHOTOS / "4.webp"])
    s3_proxy.throttle(renditions_put)
    worker = s3_env.start("run", DARKROOM_S3_ENDPOINT_URL=s3_proxy.url)
    # 4 renditions × botocore's 3 tries is one failed upload: wait for a second one
    until(lambda: s3_proxy.denied >= 24, "two throttled uploads", worker)
    s3_proxy.throttle(lambda method, path: False)
    wait_for(s3_env, "SELECT 1 FROM photos WHERE processing_state = 'processed'", proc=worker)
    lines = stop(worker)
    waits = events(lines, "transient error; waiting in place")
    assert waits and {(w["error_code"], w["reason"]) for w in waits} == {
        ("storage_unavailable", "throttled")}  # fmt: skip
    assert not events(lines, "attempt failed; will retry")
    assert not events(lines, "dependency down: pausing intake"), "the probe passed throughout"
    assert state(s3_env, photo_id) == ("processed", "published", 1)
    assert s3_env.redis.xlen(s3_env.dead) == 0


def test_s3_slowdown_past_the_transient_budget_fails_with_storage_unavailable(
    s3_env: Env, s3_proxy: DenyingS3Proxy
) -> None:
    """Throttled for longer than DARKROOM_TRANSIENT_BUDGET_S (2 s here): the photo fails
    once, as storage_unavailable, on its first attempt, saying the budget was spent."""
    [photo_id] = s3_env.ingest([PHOTOS / "4.webp"])
    s3_proxy.throttle(renditions_put)
    run = s3_env.cli(
        "run", "--drain", DARKROOM_S3_ENDPOINT_URL=s3_proxy.url, DARKROOM_TRANSIENT_BUDGET_S="2"
    )
    lines = log_lines(run.stderr)
    assert events(lines, "transient error; waiting in place")
    assert not events(lines, "attempt failed; will retry")
    [failed] = events(lines, "photo failed; dead-lettered")
    assert failed["error_code"] == "storage_unavailable"
    assert "past DARKROOM_TRANSIENT_BUDGET_S (2 s)" in failed["error"]
    [(_, letter)] = s3_env.redis.xrange(s3_env.dead)
    assert (letter["photo_id"], letter["error_code"], letter["attempts"]) == (
        str(photo_id), "storage_unavailable", "1")  # fmt: skip
    assert state(s3_env, photo_id) == ("processing_failed", "unpublished", 1)


PUBLISH_WAITING = """
SELECT pid FROM pg_stat_activity
WHERE datname = $1 AND wait_event_type = 'Lock' AND query LIKE '%processing_state = ''processed''%'
"""


async def test_a_postgres_connection_killed_mid_job_counts_no_attempt(file_env: Env) -> None:
    """pg_terminate_backend of the connection publishing the photo: a transient error, the
    photo waits in place and is published on its first attempt."""
    [photo_id] = file_env.ingest([PHOTOS / "Landscape_2.jpg"])
    database = file_env.database_url.rsplit("/", 1)[1]
    worker = file_env.start("run")
    # watch outside the lock's transaction: in one, pg_stat_activity is a frozen snapshot
    test_db = await asyncpg.connect(file_env.database_url)
    watch = await asyncpg.connect(file_env.database_url)
    try:
        await until_async(lambda: watch.fetchval(
            "SELECT 1 FROM photo_jobs WHERE state = 'active'"), worker)  # fmt: skip
        async with test_db.transaction():  # the publish waits for this lock...
            await test_db.execute("SELECT 1 FROM photos WHERE id = $1 FOR UPDATE", photo_id)
            await until_async(lambda: watch.fetchval(PUBLISH_WAITING, database), worker)
            killed = await watch.fetchval(
                f"SELECT count(pg_terminate_backend(pid)) FROM ({PUBLISH_WAITING}) w", database
            )  # ...and its connection is killed while it waits
        assert killed == 1
        await until_async(lambda: watch.fetchval(
            "SELECT 1 FROM photos WHERE processing_state = 'processed'"), worker)  # fmt: skip
        assert await state_of(watch, photo_id) == ("processed", "published", 1)
    finally:
        await test_db.close()
        await watch.close()
    lines = stop(worker)
    waits = events(lines, "transient error; waiting in place")
    assert [w["error_code"] for w in waits] == ["database_unavailable"], lines
    assert not events(lines, "attempt failed; will retry")


async def state_of(conn: asyncpg.Connection, photo_id: uuid.UUID) -> tuple[str, str, int]:
    row = await conn.fetchrow(
        "SELECT p.processing_state, p.visibility, j.attempt FROM photos p"
        " JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = $1",
        photo_id,
    )
    return row["processing_state"], row["visibility"], row["attempt"]


async def until_async(query: Callable[[], Any], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not await query():
        assert time.monotonic() < deadline, "timed out"
        assert proc.poll() is None, proc.communicate()[1]
        await asyncio.sleep(0.02)


def pending(env: Env, entry_id: str) -> tuple[str, int]:
    [row] = env.redis.xpending_range(env.stream, "darkroom", entry_id, entry_id, 1)
    return row["consumer"], row["times_delivered"]


async def test_a_reclaim_from_a_live_owner_after_a_redis_outage_counts_nothing(
    s3_env: Env, s3_proxy: DenyingS3Proxy
) -> None:
    """Worker A waits in place (S3 throttles its uploads) when its Redis hangs for longer
    than CLAIM_IDLE_MS, so worker B reclaims the entry: A's lease (renewed in PostgreSQL)
    says A lives, so B counts no attempt and hands the entry back to A without a delivery;
    A publishes it once S3 and Redis are back: attempt 1."""
    settings = {"DARKROOM_CLAIM_IDLE_MS": "3000", "DARKROOM_CONCURRENCY": "1"}
    [photo_id] = s3_env.ingest([PHOTOS / "4.webp"])
    [(entry_id, _)] = s3_env.redis.xrange(s3_env.stream)
    redis_proxy = Proxy("127.0.0.1", int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]))
    s3_proxy.throttle(renditions_put)
    watch = await asyncpg.connect(s3_env.database_url)
    try:
        a = s3_env.start("run", DARKROOM_REDIS_URL=f"redis://{redis_proxy.url_host}/0",
                         DARKROOM_S3_ENDPOINT_URL=s3_proxy.url, DARKROOM_CONSUMER="a",
                         **settings)  # fmt: skip
        until(lambda: s3_proxy.denied > 0, "A's first upload", a)
        b = s3_env.start("run", DARKROOM_CONSUMER="b", **settings)
        await asyncio.sleep(3)  # B is up; A's heartbeat keeps the entry from it
        assert pending(s3_env, entry_id) == ("a", 1)
        redis_proxy.pause()  # A's Redis hangs: its heartbeat stops, its lease goes on
        # B's XAUTOCLAIM delivers it (2), then B hands it back to A (no delivery)
        until(lambda: pending(s3_env, entry_id) == ("a", 2), "B's hand-back", b)
        job = await watch.fetchrow("SELECT attempt, consumer FROM photo_jobs")
        assert (job["attempt"], job["consumer"]) == (1, "a")
        redis_proxy.resume()
        s3_proxy.throttle(lambda method, path: False)
        await until_async(lambda: watch.fetchval(
            "SELECT 1 FROM photos WHERE processing_state = 'processed'"), a)  # fmt: skip
        assert await state_of(watch, photo_id) == ("processed", "published", 1)
    finally:
        await watch.close()
        redis_proxy.resume()
    a_lines, b_lines = stop(a), stop(b)
    redis_proxy.close()
    asides = events(b_lines, "job held by a live worker; stepped aside")
    assert asides and {(x["owner"], x["handed_back"]) for x in asides} == {("a", True)}
    assert {x["outcome"] for x in events(b_lines, "entry done")} <= {"busy", "already"}
    assert [x["outcome"] for x in events(a_lines, "entry done")] == ["published"]
    assert not events(a_lines + b_lines, "attempt failed; will retry")
