"""The worker's own bookkeeping, in-process against the real servers with a controlled
clock: an entry is never run twice at once, and a drain whose final sweep keeps failing
ends as failed instead of reporting success."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio
import structlog

from darkroom import sweeper
from darkroom.errors import CorruptImageError, InternalError
from darkroom.queue.messages import Entry, task_fields
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db, leases, publishing
from darkroom.store.storage import FileStorage
from darkroom.worker import Worker
from tests.conftest import PHOTOS, REDIS_URL, Env
from tests.faults import FakeClock


@pytest.fixture
async def worker(database_url: str, tmp_path: Path) -> AsyncIterator[Worker]:
    tag = uuid.uuid4().hex[:8]
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, f"{{w{tag}}}:photos", "darkroom", "w1", f"{{w{tag}}}:dead")
    pool = await db.connect(database_url, 4)
    settings = Settings(concurrency=1, read_block_ms=100, stream=streams.stream,
                        dead_letter_stream=streams.dead_stream,
                        database_url=database_url)  # fmt: skip
    await streams.ensure_group()
    yield Worker(settings, pool, streams, FileStorage(tmp_path / "storage"), clock=FakeClock())
    await client.delete(*streams.lane_streams.values(), streams.dead_stream)
    await client.aclose()
    await pool.close()


async def test_an_entry_already_in_flight_is_not_started_twice(worker: Worker) -> None:
    """XAUTOCLAIM can hand a consumer its own in-flight entry (its heartbeat was lost):
    the intake skips it, so the photo is claimed once, not twice at once."""
    photo_id = uuid.uuid4()
    await db.insert_photo(worker.pool, photo_id, "originals/x.jpg")
    entry_id = await worker.streams.enqueue(task_fields(photo_id))
    entry = Entry(entry_id, task_fields(photo_id))
    assert worker.in_flight.admit(entry_id)
    async with anyio.create_task_group() as tg:
        await worker._dispatch(tg, [entry])
    assert len(worker.in_flight) == 1
    assert await worker.pool.fetchval("SELECT count(*) FROM photo_jobs") == 0


async def test_a_consumer_that_lost_the_entry_cannot_fail_what_its_new_owner_publishes(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claims a photo and loses its entry to B (XCLAIM, as XAUTOCLAIM does after a lost
    heartbeat). A's render then fails for good while B renders: A's failure, under the
    older token of its own claim, records nothing and leaves the entry to B, and B
    publishes; no dead letter."""
    a, client = worker, worker.streams.client
    b_streams = Streams(client, a.streams.stream, "darkroom", "w2", a.streams.dead_stream)
    b = Worker(a.settings, a.pool, b_streams, a.storage, clock=FakeClock())
    photo_id = uuid.uuid4()
    key = f"originals/{photo_id}/4.webp"
    await a.storage.put(key, (PHOTOS / "4.webp").read_bytes(), "image/webp")
    await db.insert_photo(a.pool, photo_id, key)
    await a.streams.enqueue(task_fields(photo_id))
    [entry] = await a.streams.read_new(1, 100)
    # A's claim (no lease of its own: B may take the job at once), held as A's delivery
    a_claim = await leases.claim(a.pool, photo_id, entry.id, "w1")
    assert a_claim.outcome == "claimed"
    assert a.in_flight.admit(entry.id)
    a.in_flight.claimed(entry.id, a_claim)
    await client.xclaim(a.streams.stream, "darkroom", "w2", 0, [entry.id])
    publish, pending_after_a = publishing.publish, []

    async def publish_after_a_fails(*args: object) -> publishing.Published:
        late = CorruptImageError("A's render failed after B took the entry")
        await a.jobs._fail(entry, 1, late, structlog.get_logger())
        pending_after_a.extend(
            await client.xpending_range(a.streams.stream, "darkroom", "-", "+", 9)
        )
        return await publish(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(publishing, "publish", publish_after_a_fails)
    async with b.renderer:
        await b.jobs.handle(entry, 2)
    row = await a.pool.fetchrow(
        "SELECT p.processing_state, p.visibility, p.error_code, j.state, j.consumer"
        " FROM photos p JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = $1",
        photo_id,
    )
    assert [p["consumer"] for p in pending_after_a] == ["w2"], "A left the entry to B"
    assert tuple(row) == ("processed", "published", None, "done", "w2")
    assert await client.xlen(a.streams.dead_stream) == 0
    assert await client.xlen(a.streams.stream) == 0, "B acked its entry"


async def test_drain_ends_failed_when_the_final_sweep_keeps_failing(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final sweep of `run --drain` is retried with backoff, then the drain is marked
    failed (the CLI exits 1) instead of claiming everything was finished."""
    calls = 0

    async def broken_sweep(*args: object) -> list[uuid.UUID]:
        nonlocal calls
        calls += 1
        raise InternalError("sweep exploded")

    monkeypatch.setattr(sweeper, "sweep", broken_sweep)
    with anyio.fail_after(30):
        await worker.run(drain=True)
    assert calls == 3
    assert worker.drain_failed is not None and worker.drain_failed.code == "internal_error"
    assert isinstance(worker.clock, FakeClock) and len(worker.clock.sleeps) == 2


def test_run_drain_exits_non_zero_when_its_final_sweep_fails(file_env: Env) -> None:
    """Through the CLI, with a real fault: a Redis user that may not XRANGE (the sweep's
    read) but may do all the worker's other work: exit 1, saying the drain is incomplete."""
    # a photo committed an hour ago whose XADD never happened: the sweep must look
    lost = (
        "INSERT INTO photos (id, original_key, updated_at, last_activity_at)"
        " VALUES ($1, 'x', now() - interval '1h', now() - interval '1h')"
    )
    file_env.query(lost, uuid.uuid4())
    user = f"darkroom_{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(REDIS_URL)
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                      commands=["+@all", "-xrange"])  # fmt: skip
    try:
        url = REDIS_URL.replace("redis://", f"redis://{user}:pw@")
        # the PostgreSQL intake would enqueue the photo before the sweep looks: off here
        result = file_env.cli("run", "--drain", check=False, DARKROOM_REDIS_URL=url,
                              DARKROOM_SWEEP_AFTER_S="1", DARKROOM_PG_INTAKE="false")  # fmt: skip
    finally:
        admin.acl_deluser(user)
        admin.close()
    assert result.returncode == 1, result.stderr
    assert "final sweep failed; drain incomplete" in result.stderr


async def test_a_consumer_that_lost_the_entry_writes_no_dead_letter_for_it(
    worker: Worker,
) -> None:
    """A slow consumer's dead letter for an entry another consumer reclaimed is refused:
    the new owner writes the one letter (the chaos test once saw two for one entry)."""
    client, a = worker.streams.client, worker.streams
    b = Streams(client, a.stream, "darkroom", "w2", a.dead_stream)
    entry_id = await a.enqueue({"bad": "entry"})
    [_] = await a.read_new(1, 100)
    await client.xclaim(a.stream, "darkroom", "w2", 0, [entry_id])
    assert await a.dead_letter(entry_id, {"photo_id": ""}) == ""
    assert await client.xlen(a.dead_stream) == 0
    assert await b.dead_letter(entry_id, {"photo_id": ""})
    assert await client.xlen(a.dead_stream) == 1 and await client.xlen(a.stream) == 0


async def _waiting_on_locks(pool: db.Pool) -> int:
    return int(await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ))  # fmt: skip


async def test_a_swept_photo_is_claimed_by_its_first_delivery(worker: Worker) -> None:
    """A photo whose entry Redis lost is swept back into the stream and rendered by the
    very first delivery of its new entry: its claim finds the job row, instead of
    answering `busy` and leaving the entry for DARKROOM_CLAIM_IDLE_MS. The photo's row is
    held locked while the sweep and the delivery meet, the worst order for the claim."""
    photo_id, pool, streams = uuid.uuid4(), worker.pool, worker.streams
    key = f"originals/{photo_id}/4.webp"
    await worker.storage.put(key, (PHOTOS / "4.webp").read_bytes(), "image/webp")
    await db.insert_photo(pool, photo_id, key)
    await pool.execute(
        "UPDATE photos SET last_activity_at = now() - interval '1 hour' WHERE id = $1", photo_id
    )
    outcomes: list[str] = []

    async def first_delivery() -> None:
        while not (entries := await streams.read_new(1, 100)):
            pass
        outcomes.append(await worker.jobs._resilient(entries[0], 1))

    async def both_waiting() -> bool:
        """The sweep waits for the photo; once it has XADDed, the delivery's claim too."""
        waiting = await _waiting_on_locks(pool)
        return waiting >= 2 or (waiting == 1 and not await streams.client.xlen(streams.stream))

    async with (
        worker.renderer,
        pool.acquire() as locker,
        anyio.create_task_group() as tg,
        locker.transaction(),
    ):
        await locker.execute("SELECT 1 FROM photos WHERE id = $1 FOR UPDATE", photo_id)
        tg.start_soon(first_delivery)
        tg.start_soon(sweeper.sweep, pool, streams, 60)
        for _ in range(3000):  # a minute at most
            if await both_waiting():
                break
            await anyio.sleep(0.02)
    assert outcomes == ["published"]
    assert await db.photo_state(pool, photo_id) == "processed"
