"""The feeder's reserve against real PostgreSQL and Redis, in process: sized from the live
bulk consumers' places, filled at once, and topped up as soon as a worker says it took
entries (Streams.say_taken), in fair order."""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
import redis.asyncio

from darkroom.feeder import BULK_POLL_S, Feeder
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db
from tests.conftest import REDIS_URL

ROW_SQL = "INSERT INTO photos (id, original_key, lane, tenant) VALUES ($1, $2, 'bulk', $3)"


@pytest.fixture
async def streams() -> AsyncIterator[Streams]:
    tag = uuid.uuid4().hex[:8]
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, f"{{f{tag}}}:photos", "darkroom", "w1", f"{{f{tag}}}:dead")
    await streams.ensure_group()
    yield streams
    bulk = streams.for_lane("bulk")
    await client.delete(*streams.lane_streams.values(), streams.dead_stream, bulk.taken_key)
    await client.aclose()


async def add_backlog(pool: db.Pool, tenants: list[str], each: int) -> None:
    for _ in range(each):
        for tenant in tenants:
            photo_id = uuid.uuid4()
            await pool.execute(ROW_SQL, photo_id, f"originals/{photo_id}/x.jpg", tenant)


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    with anyio.fail_after(timeout_s):  # a hang guard, not a speed figure
        while not await check():  # noqa: ASYNC110 (the state is in Redis)
            await anyio.sleep(0.02)


async def fed_tenants(streams: Streams) -> list[str]:
    """In entry order (Streams has XRANGE answer raw: [id, [name, value, ...]])."""
    entries = await streams.client.xrange(streams.for_lane("bulk").stream)
    return [dict(zip(flat[::2], flat[1::2], strict=True))["tenant"] for _, flat in entries]


async def test_the_reserve_holds_every_live_worker_s_places_and_is_topped_up_as_they_take(
    database_url: str, streams: Streams
) -> None:
    """Two workers read the bulk lane (concurrency 2: 4 regular places each): the feeder
    puts 8 entries in the bulk stream and no more while nobody takes one; a worker takes 3
    and says so: none is fed yet (it tops up by halves); it takes one more: 4 more are fed,
    in one batch, and 8 wait again. Two tenants of equal weight alternate."""
    pool = await db.connect(database_url, 4)
    settings = Settings(concurrency=2, database_url=database_url, stream=streams.stream,
                        dead_letter_stream=streams.dead_stream)  # fmt: skip
    bulk = streams.for_lane("bulk")
    second = Streams(streams.client, streams.stream, "darkroom", "w2", streams.dead_stream)
    for worker in (streams, second):
        await worker.join()  # as a worker does at its start
    await add_backlog(pool, ["a", "b"], 20)
    feeder = Feeder(settings, pool, streams, anyio.Event(), "test/feeder")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feeder.run)
            await wait_until(lambda: _length_is(bulk, 8))
            await anyio.sleep(3 * BULK_POLL_S)  # a few polls: still 8, none beyond the reserve
            assert await bulk.undelivered() == 8
            assert len(await bulk.read_new(3, None)) == 3
            await bulk.say_taken(3)
            await anyio.sleep(3 * BULK_POLL_S)
            assert await bulk.undelivered() == 5
            assert len(await bulk.read_new(1, None)) == 1
            await bulk.say_taken(1)
            await wait_until(lambda: _length_is(bulk, 12))
            assert await bulk.undelivered() == 8
            feeder.stop()
    finally:
        await pool.close()
    tenants = await fed_tenants(streams)
    assert all(x != y for x, y in itertools.pairwise(tenants)), tenants
    assert Counter(tenants) == {"a": 6, "b": 6}


async def _length_is(bulk: Streams, n: int) -> bool:
    return int(await bulk.client.xlen(bulk.stream)) == n


async def test_a_set_reserve_is_kept_whatever_the_workers(
    database_url: str, streams: Streams
) -> None:
    """DARKROOM_BULK_AHEAD set: that many entries wait, however many workers read."""
    pool = await db.connect(database_url, 4)
    settings = Settings(concurrency=2, database_url=database_url, stream=streams.stream,
                        dead_letter_stream=streams.dead_stream, bulk_ahead=3)  # fmt: skip
    bulk = streams.for_lane("bulk")
    await add_backlog(pool, ["a"], 10)
    feeder = Feeder(settings, pool, streams, anyio.Event(), "test/feeder")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feeder.run)
            await wait_until(lambda: _length_is(bulk, 3))
            await anyio.sleep(3 * BULK_POLL_S)
            assert await bulk.undelivered() == 3
            feeder.stop()
    finally:
        await pool.close()


async def test_the_reserve_grows_while_workers_take_quickly(
    database_url: str, streams: Streams
) -> None:
    """One worker's 4 places, taken as fast as they are fed (a worker on tiny photos): the
    feeder's reserve grows past the places (queue/reserve.py), so a top-up feeds tens of
    entries at a time; with nothing taken for its window, it falls back to the places."""
    pool = await db.connect(database_url, 4)
    settings = Settings(concurrency=2, database_url=database_url, stream=streams.stream,
                        dead_letter_stream=streams.dead_stream)  # fmt: skip
    bulk = streams.for_lane("bulk")
    await streams.join()
    await add_backlog(pool, ["a"], 600)
    feeder = Feeder(settings, pool, streams, anyio.Event(), "test/feeder")
    most = 0
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feeder.run)
            await wait_until(lambda: _length_is(bulk, 4))
            with anyio.move_on_after(10):  # a hang guard: the backlog runs out well before
                while most <= 12:
                    most = max(most, await bulk.undelivered())
                    if taken := await bulk.read_new(100, None):
                        await bulk.say_taken(len(taken))
                    await anyio.sleep(0.01)
            feeder.stop()
    finally:
        await pool.close()
    assert most > 12, "the reserve stayed at the places' 4"
