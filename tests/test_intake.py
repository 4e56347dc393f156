"""The PostgreSQL intake against real PostgreSQL and Redis: rows whose producer XADDed them
are never enqueued again, however long their entries wait unread; a row nobody XADDed is
enqueued (the delivery horizon, queue/horizon.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import anyio
import redis.asyncio

from darkroom.feeder import Feeder
from darkroom.queue.horizon import MAX_MARKS, Horizon
from darkroom.queue.messages import task_fields
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db
from tests.conftest import REDIS_URL, Env
from tests.test_feeder import insert_row, processed, start_feeding, wait_for

INSERT = "INSERT INTO photos (id, original_key) VALUES ($1, $2)"  # enqueued_at stays NULL


def entries_added(env: Env) -> int:
    """Every XADD the stream ever took (Redis 7), acked and deleted ones included."""
    return int(env.redis.xinfo_stream(env.stream)["entries-added"])


async def produce(pool: db.Pool, streams: Streams, count: int) -> None:
    """The seeds' way: the row (enqueued_at NULL), then the entry."""
    for _ in range(count):
        photo_id = uuid.uuid4()
        await pool.execute(INSERT, photo_id, f"originals/{photo_id}/a.jpg")
        await streams.enqueue(task_fields(photo_id))


async def test_entries_nobody_reads_yet_are_not_enqueued_again(file_env: Env) -> None:
    """1,000 photos queued row then XADD, no worker reading: the intake runs past its grace
    and through a catch-up scan and adds no entry; the stream holds exactly the 1,000."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, file_env.stream, "darkroom", "feeder", file_env.dead)
    pool = await db.connect(file_env.database_url, 4)
    settings = Settings(stream=streams.stream, dead_letter_stream=streams.dead_stream,
                        database_url=file_env.database_url)  # fmt: skip
    feeder = Feeder(settings, pool, streams, anyio.Event(), "feeder")
    try:
        await streams.ensure_group()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(feeder.run)
            await produce(pool, streams, 1_000)
            await anyio.sleep(3.0)  # the grace, notified passes, a catch-up scan
            feeder.stop()
        assert await client.xlen(streams.stream) == 1_000
        assert int((await client.xinfo_stream(streams.stream))["entries-added"]) == 1_000
    finally:
        await pool.close()
        await client.aclose()


def test_a_backlog_behind_a_busy_worker_gets_no_duplicate_entry(file_env: Env) -> None:
    """One render slot, 120 photos queued row then XADD: every photo is rendered from its
    producer's entry alone (the stream took 120 XADDs); then, the queue idle, a row nobody
    XADDed is enqueued by the intake and rendered."""
    start_feeding(file_env, DARKROOM_CONCURRENCY="1", DARKROOM_INTERACTIVE_SLOTS="0")
    ids = []
    for _ in range(120):
        ids.append(insert_row(file_env))
        file_env.redis.xadd(file_env.stream, {"photo_id": str(ids[-1])})
    wait_for(lambda: processed(file_env, ids), 180)
    assert entries_added(file_env) == 120
    alone = insert_row(file_env)
    wait_for(lambda: processed(file_env, [alone]))
    assert entries_added(file_env) == 121


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_mark_is_used_only_once_delivered_past_and_claimed() -> None:
    """A mark taken behind undelivered entries gives no bound; once the group has delivered
    past it, it gives one only after the claim grace."""
    horizon = Horizon(claim_grace_s=0.25)
    horizon.observe(T0, "100-5", "90-0", now=0.0)  # entry 90 waits: not ripe
    assert horizon.bound(1.0) is None and horizon.next_usable(1.0) is None
    horizon.observe(T0 + timedelta(seconds=2), "200-0", "100-6", now=2.0)  # past 100-5
    assert horizon.bound(2.1) is None and horizon.next_usable(2.1) == 2.25
    mark = horizon.bound(2.3)
    assert mark is not None and mark.taken_at == T0


def test_an_idle_stream_ripens_its_mark_at_once_and_a_lost_stream_too() -> None:
    """Nothing undelivered (or no stream at all, Redis restarted empty): the mark is ripe
    when taken, so a row nobody XADDed is due after the two graces, as with no backlog."""
    horizon = Horizon(claim_grace_s=0.25)
    horizon.observe(T0, "0-0", None, now=0.0)
    mark = horizon.bound(0.25)
    assert mark is not None and mark.taken_at == T0


def test_marks_past_the_cap_are_thinned_never_made_newer() -> None:
    """Behind a long backlog the unripe marks are thinned; the newest is kept."""
    horizon = Horizon(claim_grace_s=0.0)
    for i in range(MAX_MARKS + 1):
        horizon.observe(T0 + timedelta(seconds=i), f"{i + 1}-0", "0-1", now=float(i))
    assert len(horizon.marks) <= MAX_MARKS
    assert horizon.marks[-1].last_id == (MAX_MARKS + 1, 0)
    horizon.observe(T0 + timedelta(days=1), "9999-0", None, now=10_000.0)
    mark = horizon.bound(10_000.0)
    assert mark is not None and mark.taken_at == T0 + timedelta(days=1)
