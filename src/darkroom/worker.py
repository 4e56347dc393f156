"""Orchestration: intake (own pending, reclaim, new reads) into free slots, one task per
entry, the heartbeat of in-flight entries, the Postgres sweep, and the graceful stop.
The only module that creates task groups.

Ordering hazards: never read more entries than there are free slots; stop between reads,
never cancel a read in flight; take no new work while a dependency is down.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import anyio
import structlog
from anyio.abc import TaskGroup

from darkroom import db, metrics, sweeper
from darkroom.errors import DarkroomError
from darkroom.health import DEPENDENCIES, Gate
from darkroom.jobs import Jobs
from darkroom.messages import Entry
from darkroom.renderer import RenderPool
from darkroom.settings import Settings
from darkroom.storage import Storage
from darkroom.streams import Streams

log = structlog.get_logger("darkroom.worker")

RECLAIM_EVERY_S = 0.5


@dataclass
class Worker:
    settings: Settings
    pool: db.Pool
    streams: Streams
    storage: Storage
    stopping: anyio.Event = field(default_factory=anyio.Event)
    in_flight: set[str] = field(default_factory=set)
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _next_reclaim: float = 0.0

    def __post_init__(self) -> None:
        self.gate = Gate(
            {
                "queue": self.streams.ping,
                "database": lambda: db.ping(self.pool),
                "storage": self.storage.probe,
            },
            self.stopping,
        )
        self.renderer = RenderPool.from_settings(self.settings)  # owns the render slots
        self.jobs = Jobs(
            self.settings, self.pool, self.streams, self.storage, self.gate, self.renderer,
            self.stopping,
        )  # fmt: skip

    def stop(self) -> None:
        """First signal: stop reading; in-flight photos finish within the grace period."""
        self.stopping.set()
        self._notify()

    def ready(self) -> bool:
        return not self.stopping.is_set() and self.gate.is_open()

    async def run(self, *, drain: bool = False) -> None:
        async with self.renderer, anyio.create_task_group() as services:
            services.start_soon(self._heartbeat_loop)
            services.start_soon(self._sweep_loop)
            async with anyio.create_task_group() as jobs:
                await self._intake(jobs, drain)
                with anyio.move_on_after(self.settings.shutdown_grace_s):
                    await self._wait(lambda: not self.in_flight)
                if self.in_flight:
                    log.warning("grace period over; left pending", entries=sorted(self.in_flight))
                jobs.cancel_scope.cancel()
            services.cancel_scope.cancel()

    # -- intake ---------------------------------------------------------------------------

    def _free(self) -> int:
        return self.settings.concurrency - len(self.in_flight)

    async def _intake(self, jobs: TaskGroup, drain: bool) -> None:
        """Read until stopped (or drained); an outage pauses it, never ends it."""
        started = False
        while not self.stopping.is_set():
            try:
                if not started:
                    await self.streams.ensure_group()
                    # Only at start: later, what this consumer holds is in flight or backing off.
                    await self._dispatch(jobs, await self.streams.read_own_pending(self._free()))
                    started = True
                if await self._intake_step(jobs, drain):
                    return
            except DarkroomError as exc:
                log.warning("intake call failed", error_code=exc.code, error=str(exc))
                await self._recover(exc)

    async def _recover(self, exc: DarkroomError) -> None:
        """Wait out the outage, then re-create the group (Redis may have restarted empty) and
        refresh in-flight entries at once, before other consumers see them idle."""
        if exc.stage in DEPENDENCIES:
            await self.gate.wait(exc.stage)
        else:
            await anyio.sleep(1)
        with contextlib.suppress(DarkroomError):
            await self.streams.ensure_group()
            await self.streams.heartbeat(sorted(self.jobs.active))

    async def _intake_step(self, jobs: TaskGroup, drain: bool) -> bool:
        """Reclaim and read once into the free slots; True once drained."""
        await self._wait(
            lambda: (self._free() > 0 and self.gate.is_open()) or self.stopping.is_set()
        )
        if self.stopping.is_set():
            return False
        if time.monotonic() >= self._next_reclaim:
            await self._reclaim(jobs)
            self._next_reclaim = time.monotonic() + RECLAIM_EVERY_S
            if self._free() == 0:
                return False
        entries = await self.streams.read_new(self._free(), self._block_ms(drain))
        await self._dispatch(jobs, entries, fresh=True)
        return drain and not entries and await self._drained()

    def _block_ms(self, drain: bool) -> int:
        # While retries wait in the PEL, poll often enough to reclaim them on time.
        return min(self.settings.read_block_ms, 500) if drain else self.settings.read_block_ms

    async def _drained(self) -> bool:
        """Nothing in flight or pending, and Postgres knows of no lost photo to re-enqueue."""
        if self.in_flight or await self.streams.pending_count():
            return False
        return not await self._sweep_once()

    async def _reclaim(self, jobs: TaskGroup) -> None:
        entries, deleted = await self.streams.reclaim(self.settings.claim_idle_ms, self._free())
        metrics.RECLAIMED.inc(len(entries))
        await self._dispatch(jobs, entries)
        if deleted:
            # XAUTOCLAIM has already dropped these from the PEL: if this fails, the sweep
            # finds the photos later.
            metrics.DELETED_WHILE_PENDING.inc(len(deleted))
            try:
                photos = await sweeper.requeue_deleted(self.pool, self.streams, deleted)
            except DarkroomError as exc:
                log.warning("could not re-enqueue deleted entries", error=str(exc))
                return
            metrics.REQUEUED.labels("deleted_while_pending").inc(len(photos))
            log.warning("pending entries were deleted; photos re-enqueued",
                        entries=len(deleted), photos=[str(p) for p in photos])  # fmt: skip

    async def _dispatch(
        self, jobs: TaskGroup, entries: list[Entry], *, fresh: bool = False
    ) -> None:
        for entry in entries:
            deliveries = 1 if fresh else await self.streams.deliveries(entry.id)
            self.in_flight.add(entry.id)
            metrics.IN_FLIGHT.set(len(self.in_flight))
            jobs.start_soon(self._run_one, entry, deliveries)

    async def _run_one(self, entry: Entry, deliveries: int) -> None:
        try:
            await self.jobs.handle(entry, deliveries)
        finally:
            self.in_flight.discard(entry.id)
            metrics.IN_FLIGHT.set(len(self.in_flight))
            self._notify()

    async def _wait(self, condition: object) -> None:
        assert callable(condition)
        while not condition():
            with anyio.move_on_after(1):  # the gate reopens without a notification
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- background loops -------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Keep in-flight entries young so no other consumer steals a slow photo."""
        period_s = min(self.settings.claim_idle_ms / 3000, 10.0)
        while True:
            await anyio.sleep(period_s)
            try:
                await self.streams.heartbeat(sorted(self.jobs.active))
            except DarkroomError as exc:
                log.warning("heartbeat failed", error=str(exc))

    async def _sweep_loop(self) -> None:
        period_s = max(1.0, min(self.settings.sweep_after_s / 2, 60.0))
        while True:
            await anyio.sleep(period_s)
            if self.gate.is_open() and not self.stopping.is_set():
                await self._sweep_once()

    async def _sweep_once(self) -> int:
        try:
            photos = await sweeper.sweep(self.pool, self.streams, self.settings.sweep_after_s)
        except DarkroomError as exc:
            log.warning("sweep failed", error=str(exc))
            return 0
        if photos:
            metrics.REQUEUED.labels("sweep").inc(len(photos))
            log.warning("swept lost photos back into the stream", count=len(photos))
        return len(photos)
