"""Lanes: admission between interactive and bulk (pure), the reserved render slot, and the
intake of a worker against the real Redis: interactive work starts while bulk fills every
regular place, bulk keeps its floor, and every entry stays in its own lane's stream."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest
import redis.asyncio

from darkroom import sweeper
from darkroom.config.env import from_env
from darkroom.errors import SettingsError
from darkroom.image.slots import REGULAR_NICE, Slots
from darkroom.queue import admission
from darkroom.queue.admission import Places, Reads
from darkroom.queue.lanes import MAX_TENANT_CHARS, entry_tenant
from darkroom.queue.messages import Entry, parse_task, received, task_fields
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db
from darkroom.store import lanes as store_lanes
from darkroom.store.storage import FileStorage
from darkroom.worker import Worker
from tests.conftest import REDIS_URL
from tests.faults import FakeClock
from tests.test_renderer import DEFAULTS, HEIC, SMALL, pool

# concurrency 2: 4 regular places, 2 reserved (one reserved slot), a floor of 1
PLACES = Places.of(4, 2, 0.25)


def test_a_floor_share_above_zero_keeps_at_least_one_place() -> None:
    """A quarter of 4 places is 1, of 1 place still 1; a share of 0 keeps none."""
    assert (Places.of(4, 2, 0.25).floor, Places.of(1, 2, 0.25).floor) == (1, 1)
    assert (Places.of(8, 2, 0.25).floor, Places.of(4, 2, 0.0).floor) == (2, 0)


def test_a_bulk_floor_above_one_is_refused() -> None:
    """DARKROOM_BULK_FLOOR is a share of the regular places: 1.5 names the variable."""
    with pytest.raises(SettingsError) as caught:
        from_env({"DARKROOM_BULK_FLOOR": "1.5"})
    assert caught.value.variable == "DARKROOM_BULK_FLOOR"


def test_the_sweep_looks_for_a_photo_in_its_own_lane_and_leaves_unfed_bulk_to_the_feeder() -> None:
    """A bulk photo not fed yet is not lost; one fed is looked for in the bulk stream."""
    assert sweeper.is_in_stream_of({"lane": "bulk", "unfed": False}, "bulk")
    assert not sweeper.is_in_stream_of({"lane": "bulk", "unfed": True}, "bulk")
    assert not sweeper.is_in_stream_of({"lane": "bulk", "unfed": False}, "interactive")
    assert sweeper.is_in_stream_of({"lane": "interactive", "unfed": True}, "interactive")


def test_interactive_gets_its_reserved_places_while_bulk_fills_every_regular_one() -> None:
    """Bulk holding all 4 regular places leaves interactive its 2 reserved ones."""
    assert admission.interactive_room(PLACES, 0, 4, bulk_waiting=True) == 2
    assert admission.bulk_room(PLACES, 0, 4) == 0


def test_bulk_uses_every_regular_place_interactive_does_not_hold() -> None:
    """Work conserving: with no interactive work, bulk may fill all regular places."""
    assert admission.bulk_room(PLACES, 0, 0) == 4
    assert admission.bulk_room(PLACES, 2, 0) == 4, "interactive sits on its reserved places"
    assert admission.bulk_room(PLACES, 3, 0) == 3


def test_the_floor_keeps_a_place_for_bulk_only_while_bulk_has_work() -> None:
    """Under interactive load bulk keeps 1 place if it has work waiting, none if idle."""
    assert admission.interactive_room(PLACES, 0, 0, bulk_waiting=True) == 5
    assert admission.interactive_room(PLACES, 0, 0, bulk_waiting=False) == 6
    assert admission.interactive_room(PLACES, 5, 0, bulk_waiting=True) == 0
    assert admission.interactive_room(PLACES, 5, 1, bulk_waiting=True) == 0
    assert admission.interactive_room(PLACES, 4, 1, bulk_waiting=True) == 1


def test_a_blocking_read_never_asks_for_more_than_the_free_places() -> None:
    """Both lanes when two places are free; interactive alone with the last place."""
    assert admission.blocking_reads(PLACES, 0, 0) == Reads(1, 1)
    assert admission.blocking_reads(PLACES, 0, 4) == Reads(1, 0)
    assert admission.blocking_reads(PLACES, 2, 3) == Reads(1, 0)
    assert admission.blocking_reads(PLACES, 2, 4).lanes() == []


async def test_an_interactive_render_takes_a_reserved_slot_while_bulk_holds_the_others() -> None:
    """With the one regular slot busy, interactive starts at once; more bulk waits."""
    slots = Slots(regular=1, reserved=1)
    assert await slots.acquire(interactive=False) == "regular"
    with anyio.fail_after(1):
        assert await slots.acquire(interactive=True) == "reserved"
    with anyio.move_on_after(0.2) as waited:
        await slots.acquire(interactive=False)
    assert waited.cancelled_caught, "bulk may not take the reserved slot"
    slots.release("regular", interactive=False)
    with anyio.fail_after(1):
        assert await slots.acquire(interactive=False) == "regular"


async def test_with_no_bulk_rendering_interactive_renders_no_more_at_once_than_cores() -> None:
    """Interactive alone renders at most `regular` photos at once, the first on the reserved
    slot; once bulk renders, interactive may use the reserved slot and every free one."""
    slots = Slots(regular=2, reserved=1)
    assert [await slots.acquire(interactive=True) for _ in range(2)] == ["reserved", "regular"]
    with anyio.move_on_after(0.2) as waited:
        await slots.acquire(interactive=True)
    assert waited.cancelled_caught, "a third interactive render waits: two cores, two renders"
    with anyio.fail_after(1):
        assert await slots.acquire(interactive=False) == "regular"  # bulk renders now
    slots.release("reserved", interactive=True)
    with anyio.fail_after(1):
        assert await slots.acquire(interactive=True) == "reserved"
        slots.release("regular", interactive=True)
        assert await slots.acquire(interactive=True) == "regular"
    assert (slots.interactive, slots.bulk) == (2, 1)


async def test_an_upload_renders_beside_a_full_bulk_load_in_a_process_that_is_not_nicer() -> None:
    """With a reserved slot, the regular slots' processes run at a lower CPU priority, and
    an interactive render started while the regular slot is busy finishes first."""
    renderer = pool(1, reserved=1)
    async with renderer:
        nice = {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in renderer.pids()}
        assert sorted(nice.values()) == [os.nice(0), os.nice(0) + REGULAR_NICE]
        finished: list[str] = []

        async def render(lane: str, data: bytes) -> None:
            await renderer.render(data, DEFAULTS, interactive=lane == "interactive")
            finished.append(lane)

        async with anyio.create_task_group() as tg:
            tg.start_soon(render, "bulk", HEIC)
            await anyio.sleep(0.1)
            tg.start_soon(render, "interactive", SMALL)
    assert finished == ["interactive", "bulk"]


def test_a_bulk_entry_names_a_tenant_any_worker_accepts_whatever_the_row_holds() -> None:
    """A tenant of 1,000 four-byte characters (no database constraint) becomes its first
    128 characters in the feeder's entry: 512 bytes, not a bad_message."""
    photo_id = uuid.uuid4()
    tenant = entry_tenant("\U0001f600" * 1000)
    assert (tenant, entry_tenant("acme")) == ("\U0001f600" * MAX_TENANT_CHARS, "acme")
    sent = [b"photo_id", str(photo_id).encode(), b"tenant", tenant.encode()]
    assert parse_task(received("1-0", sent, "bulk")).photo_id == photo_id


async def test_to_feeder_says_whether_the_feeder_took_the_photo(database_url: str) -> None:
    """True for an unfinished photo (now bulk and unfed); False for a missing photo and for
    a processed one with no re-render asked (both left as they were)."""
    pool = await db.connect(database_url, 1)
    try:
        photo_id = uuid.uuid4()
        await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
        assert await store_lanes.to_feeder(pool, photo_id) is True
        row = await pool.fetchrow("SELECT lane, enqueued_at FROM photos WHERE id = $1", photo_id)
        assert (row["lane"], row["enqueued_at"]) == ("bulk", None)
        assert await store_lanes.to_feeder(pool, uuid.uuid4()) is False
        await pool.execute("UPDATE photos SET processing_state = 'processed', processed_at = now(),"
                           " enqueued_at = now() WHERE id = $1", photo_id)  # fmt: skip
        assert await store_lanes.to_feeder(pool, photo_id) is False
        assert await pool.fetchval("SELECT enqueued_at FROM photos WHERE id = $1", photo_id)
    finally:
        await pool.close()


@pytest.fixture
async def worker(database_url: str, tmp_path: Path) -> AsyncIterator[Worker]:
    tag = uuid.uuid4().hex[:8]
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, f"{{l{tag}}}:photos", "darkroom", "w1", f"{{l{tag}}}:dead")
    pool = await db.connect(database_url, 4)
    settings = Settings(concurrency=2, read_block_ms=100, stream=streams.stream,
                        dead_letter_stream=streams.dead_stream)  # fmt: skip
    await streams.ensure_group()
    yield Worker(settings, pool, streams, FileStorage(tmp_path / "storage"), clock=FakeClock())
    await client.delete(*streams.lane_streams.values(), streams.dead_stream)
    await client.aclose()
    await pool.close()


async def _backlog(streams: Streams, lane: str, count: int) -> None:
    for _ in range(count):
        await streams.for_lane(lane).enqueue(task_fields(uuid.uuid4()))


def _hold(worker: Worker, entries: list[Entry]) -> None:
    for entry in entries:
        worker.in_flight.admit(entry.id, entry.lane)


async def test_interactive_entries_are_read_while_bulk_fills_every_regular_place(
    worker: Worker,
) -> None:
    """Bulk work holds the 4 regular places: 2 interactive entries are still read."""
    await _backlog(worker.streams, "bulk", 10)
    first = await worker._read_new(drain=False)
    assert [e.lane for e in first] == ["bulk"] * 4, "bulk fills the idle worker"
    _hold(worker, first)
    await _backlog(worker.streams, "interactive", 5)
    second = await worker._read_new(drain=False)
    assert [e.lane for e in second] == ["interactive"] * 2


async def test_bulk_keeps_its_floor_under_sustained_interactive_load(worker: Worker) -> None:
    """Both lanes backlogged, nothing held: interactive takes 5 places, bulk its floor of 1."""
    await _backlog(worker.streams, "interactive", 20)
    await _backlog(worker.streams, "bulk", 20)
    entries = await worker._read_new(drain=False)
    assert sorted(e.lane for e in entries) == ["bulk"] + ["interactive"] * 5


async def test_an_idle_bulk_lane_leaves_interactive_every_place(worker: Worker) -> None:
    """No bulk work: interactive may use all 6 places (the floor keeps nothing)."""
    await _backlog(worker.streams, "interactive", 20)
    entries = await worker._read_new(drain=False)
    assert [e.lane for e in entries] == ["interactive"] * 6


async def test_a_blocking_read_picks_up_an_interactive_entry_as_it_arrives(
    worker: Worker,
) -> None:
    """Both lanes empty: the intake blocks on both, and an interactive XADD wakes it."""

    async def add_later() -> None:
        await anyio.sleep(0.05)
        await _backlog(worker.streams, "interactive", 1)

    worker.settings = msgspec.structs.replace(worker.settings, read_block_ms=3000)
    async with anyio.create_task_group() as tg:
        tg.start_soon(add_later)
        with anyio.fail_after(2):
            entries = await worker._read_new(drain=False)
    assert [e.lane for e in entries] == ["interactive"]


async def test_an_idle_bulk_lane_is_looked_at_every_eighth_turn_not_every_turn(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under sustained interactive load with no bulk work, the bulk backlog check (one round
    trip) runs on one intake turn in BULK_LOOK_EVERY; a backlog that appears meanwhile
    gets its floor at the next check."""
    from darkroom import reads

    looks = 0
    undelivered = Streams.undelivered

    async def counted(self: Streams) -> int:
        nonlocal looks
        looks += 1
        return await undelivered(self)

    monkeypatch.setattr(Streams, "undelivered", counted)
    every = reads.BULK_LOOK_EVERY
    await _backlog(worker.streams, "interactive", 6 * (every + 2))
    for _ in range(every):
        assert [e.lane for e in await worker._read_new(drain=False)] == ["interactive"] * 6
    assert looks == 1
    await _backlog(worker.streams, "bulk", 5)
    entries = await worker._read_new(drain=False)
    assert looks == 2
    assert sorted(e.lane for e in entries) == ["bulk"] + ["interactive"] * 5


class _Started:
    """Stands in for the intake's task group: records the entries it is asked to start."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.some = anyio.Event()

    def start_soon(self, func: object, entry: Entry, *args: object) -> None:
        self.entries.append(entry)
        self.some.set()


async def _blocked_reads(client: redis.asyncio.Redis) -> int:
    clients = await client.client_list()
    return sum(1 for c in clients if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", ""))


async def test_a_bulk_place_freed_while_the_intake_blocks_on_interactive_is_refilled_at_once(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bulk holds every regular place and has more waiting; the intake blocks for an
    interactive entry (a reserved place). A bulk place freed meanwhile is refilled while
    that read still waits, not after it returns; the read then takes the interactive entry."""
    from darkroom import reads

    monkeypatch.setattr(reads, "REFILL_BLOCK_MS", 20_000)
    await _backlog(worker.streams, "bulk", 10)
    held = await worker._read_new(drain=False)
    _hold(worker, held)
    started, read = _Started(), list[Entry]()

    async def intake() -> None:
        read.extend(await worker._read_new(False, started))  # type: ignore[arg-type]

    client = worker.streams.client
    before = await _blocked_reads(client)
    with anyio.fail_after(15):  # a hang guard
        async with anyio.create_task_group() as tg:
            tg.start_soon(intake)
            while await _blocked_reads(client) == before:  # noqa: ASYNC110 (in Redis)
                await anyio.sleep(0.01)
            worker.in_flight.release(held[0].id)
            worker._notify()
            await started.some.wait()
            assert not read, "refilled while the blocking read still waits"
            await _backlog(worker.streams, "interactive", 1)
    assert [e.lane for e in started.entries] == ["bulk"]
    assert [e.lane for e in read] == ["interactive"]
    assert worker.in_flight.held("bulk") == 4
