"""The worker's reads of new entries from both lanes into its free in-flight places
(queue/admission.py decides how many of each), mixed into Worker (worker.py), which owns
the state they read and the task group they start entries in.

Ordering hazards: never read more entries than there are free places (a read on its way
keeps its places counted); never cancel a read in flight. A paused lane (`paused`, the
worker's copy of queue_pauses) is neither read nor reclaimed: its entries, retries included,
keep their place in the stream.
"""

from __future__ import annotations

import contextlib

import anyio
from anyio.abc import TaskGroup

from darkroom.errors import DarkroomError
from darkroom.health import Gate
from darkroom.queue import admission
from darkroom.queue.inflight import InFlight
from darkroom.queue.messages import Entry
from darkroom.queue.pauses import Paused
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import leases

# A blocking read while bulk fills its places and has more waiting: short, so the intake
# comes round soon (a bulk place freed meanwhile is refilled beside it at once, not after).
REFILL_BLOCK_MS = 100
# Below its floor, the bulk lane's backlog is looked at (one script, one round trip) on
# every intake turn while it has work waiting, and on every 8th while it has none: an idle
# bulk lane no longer costs a round trip per photo, and a backlog that appears gets its
# floor at most 8 turns later (a turn is about one photo's worth of intake).
BULK_LOOK_EVERY = 8


class LaneReads:
    """Worker's reads (see the module's docstring); the attributes are Worker's."""

    settings: Settings
    streams: Streams
    gate: Gate
    stopping: anyio.Event
    places: admission.Places
    in_flight: InFlight[leases.Claim]
    _changed: anyio.Event
    _bulk_waiting: bool
    _bulk_turns: int
    paused: Paused

    async def _dispatch(
        self, jobs: TaskGroup, entries: list[Entry], *, fresh: bool = False
    ) -> None:
        raise NotImplementedError  # Worker's

    async def _read_new(self, drain: bool, jobs: TaskGroup | None = None) -> list[Entry]:
        """Interactive first, up to its room, then bulk into the regular places left, both
        at once; only when both came back empty, one read blocking on both (an interactive
        entry is picked up as it arrives; given `jobs`, a bulk place freed meanwhile is
        refilled beside it). Below its floor, bulk's backlog is looked at first: the floor
        keeps places only while bulk has work waiting."""
        if self.paused.lane("bulk"):
            self._bulk_waiting = False  # a paused lane keeps no floor from interactive
        elif self.in_flight.held("bulk") < self.places.floor and self._look_at_bulk():
            self._bulk_waiting = await self.streams.for_lane("bulk").undelivered() > 0
        interactive = await self._read_lane("interactive", self._room("interactive"))
        bulk = await self._read_lane("bulk", self._room("bulk", len(interactive)))
        if interactive or bulk:
            return interactive + bulk
        reads = admission.blocking_reads(self.places, *self._held())
        block_ms = REFILL_BLOCK_MS if self._bulk_waiting else self._block_ms(drain)
        lanes = [lane for lane in reads.lanes() if not self.paused.lane(lane)]
        if jobs is not None and not reads.bulk and self.in_flight.held("bulk") and lanes:
            return await self._block_refilling_bulk(jobs, reads, lanes, block_ms)
        if not lanes:
            if reads.lanes():
                await self._rest(block_ms)  # every lane with room is paused: wait for a change
            return []
        return await self.streams.read_lanes(lanes, block_ms)

    async def _rest(self, block_ms: int) -> None:
        with anyio.move_on_after(block_ms / 1000):
            await self._changed.wait()

    async def _block_refilling_bulk(
        self, jobs: TaskGroup, reads: admission.Reads, lanes: list[str], block_ms: int
    ) -> list[Entry]:
        """The blocking read waits for interactive alone (bulk had no room): a bulk place
        freed meanwhile is refilled at once beside it, on another connection, not after
        the block (its place stays counted for the read's interactive entry)."""
        async with anyio.create_task_group() as beside:
            beside.start_soon(self._refill_bulk, jobs, reads.interactive)
            entries = await self.streams.read_lanes(lanes, block_ms)
            beside.cancel_scope.cancel()
        return entries

    async def _refill_bulk(self, jobs: TaskGroup, reading: int) -> None:
        """On each place freed: bulk's room beside `reading` interactive entries on their
        way, read at once (shielded: a read in flight is never cancelled)."""
        while not self.stopping.is_set() and self.gate.is_open():
            changed = self._changed
            interactive, bulk = self._held()
            room = admission.bulk_room(self.places, interactive + reading, bulk)
            if room:
                with anyio.CancelScope(shield=True):
                    try:
                        entries = await self._read_lane("bulk", room)
                    except DarkroomError:
                        return  # the intake's own next read meets the failure
                    await self._dispatch(jobs, entries, fresh=True)
                    await self._say_taken(entries)
                if not entries:
                    return  # bulk ran dry: the next blocking read covers it
            await changed.wait()

    async def _say_taken(self, entries: list[Entry]) -> None:
        """Bulk entries taken: the feeder tops the bulk stream up now, not on its next
        poll (which remains, should this word be lost)."""
        taken = sum(1 for entry in entries if entry.lane == "bulk")
        if taken:
            with contextlib.suppress(DarkroomError):
                await self.streams.for_lane("bulk").say_taken(taken)

    def _look_at_bulk(self) -> bool:
        due = self._bulk_waiting or self._bulk_turns % BULK_LOOK_EVERY == 0
        self._bulk_turns += 1
        return due

    async def _read_lane(self, lane: str, count: int) -> list[Entry]:
        if not count or self.paused.lane(lane):
            return []
        entries = await self.streams.for_lane(lane).read_new(count, None)
        if lane == "bulk":
            self._bulk_waiting = len(entries) == count
        return entries

    def _held(self) -> tuple[int, int]:
        return self.in_flight.held("interactive"), self.in_flight.held("bulk")

    def _room(self, lane: str, interactive_read: int = 0) -> int:
        """New entries `lane` may take now (bulk: after `interactive_read` more arrived);
        none while it is paused."""
        if self.paused.lane(lane):
            return 0
        interactive, bulk = self._held()
        if lane == "interactive":
            return admission.interactive_room(self.places, interactive, bulk, self._bulk_waiting)
        return admission.bulk_room(self.places, interactive + interactive_read, bulk)

    def _block_ms(self, drain: bool) -> int:
        # While retries wait in the PEL, poll often enough to reclaim them on time.
        return min(self.settings.read_block_ms, 500) if drain else self.settings.read_block_ms
