"""Orchestration: intake (own pending, reclaim, new reads) of both lanes into free
in-flight places (queue/admission.py decides how many of each), one task per entry, the
heartbeat of in-flight entries, the Postgres sweep, and the graceful stop. The only module
that creates task groups.

Ordering hazards: never read more entries than there are free places; never run one entry
twice at once; stop between reads, never cancel a read in flight; take no new work while
a dependency is down; every loop that retries backs off and logs a repeat at most every
few seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from darkroom import latespans, metrics, recorder, sweeper
from darkroom.duty import Duty, process_holder
from darkroom.errors import DarkroomError
from darkroom.feeder import Feeder
from darkroom.health import DEPENDENCIES, Clock, Gate, RealClock
from darkroom.image.renderer import RenderPool
from darkroom.jobs import Jobs
from darkroom.pausing import PauseWatch
from darkroom.queue import admission, policy
from darkroom.queue.inflight import InFlight
from darkroom.queue.messages import Entry
from darkroom.queue.pacing import Backoff, Throttle
from darkroom.queue.pauses import Paused
from darkroom.queue.streams import Streams
from darkroom.reads import LaneReads
from darkroom.relay import Relay
from darkroom.settings import Settings
from darkroom.store import db, duties, intake, leases, probe
from darkroom.store.storage import Storage

log = structlog.get_logger("darkroom.worker")

RECLAIM_EVERY_S = 0.5
# A stop waits this long for the relay to publish the outcomes committed before it.
RELAY_FLUSH_S = 5.0
REPEAT_LOG_EVERY_S = 10.0
DRAIN_SWEEP_TRIES = 3
# `run --drain` does not wait out an outage longer than this: it stops with the work left
# pending (nothing lost) and exits 3 naming the reason, within this, the photos' release
# and the relay's flush (RELAY_FLUSH_S). A failover (about 10-30 s) is still waited out.
DRAIN_OUTAGE_S = 30.0


@dataclass
class Worker(LaneReads):
    settings: Settings
    pool: db.Pool
    streams: Streams
    storage: Storage
    clock: Clock = field(default_factory=RealClock)
    stopping: anyio.Event = field(default_factory=anyio.Event)
    # Set when `run --drain` ended without a final sweep that succeeded: exit non-zero.
    drain_failed: DarkroomError | None = None
    # Set when `run --drain` stopped in an outage longer than DRAIN_OUTAGE_S: what it was.
    drain_outage: str | None = None
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _next_reclaim: float = 0.0
    _drain_sweep_failures: int = 0
    # The bulk lane filled the last read it was offered: it has work waiting (its floor holds).
    _bulk_waiting: bool = False
    _bulk_turns: int = 0  # intake turns below bulk's floor (BULK_LOOK_EVERY)
    paused: Paused = field(default_factory=Paused)  # as pause_watch last read them

    def __post_init__(self) -> None:
        s = self.settings
        self.places = admission.Places.of(s.in_flight_bound, s.interactive_places, s.bulk_floor)
        self.in_flight: InFlight[leases.Claim] = InFlight(s.in_flight_bound + s.interactive_places)
        self.gate = Gate(
            {
                "queue": self.streams.probe,
                "database": lambda: probe.check(self.pool),
                "storage": self.storage.probe,
            },
            {"queue": self.streams.reconnect, "database": lambda: db.reconnect(self.pool)},
            self.stopping,
            clock=self.clock,
        )
        self.renderer = RenderPool.from_settings(self.settings)  # owns the render slots
        self.jobs = Jobs(self.settings, self.pool, self.streams, self.storage, self.gate,
                         self.renderer, self.stopping, self.in_flight)  # fmt: skip
        # This process as the holder of the single runners' duties (duty.py).
        holder = process_holder(s.consumer)
        self.sweep_duty = Duty(duties.SWEEP, self.pool, holder, s.duty_lease_s)
        self.prune_duty = Duty(duties.PRUNE, self.pool, holder, s.duty_lease_s)
        self.relay = Relay.from_settings(self.settings, self.streams.client, self.pool, holder)
        # Its own clock: the feeder's waits are not the intake's (a test's fake clock counts
        # the intake's backoff).
        self.feeder = Feeder(self.settings, self.pool, self.streams, self.stopping, holder)
        self.pause_watch = PauseWatch(self.pool, self._heed)
        self.late_spans = latespans.LateSpans(self.pool, self.streams)  # traced workers only

    def _heed(self, paused: Paused) -> None:
        """The pauses changed: the intake and the feeder act on them from their next turn."""
        self.paused = paused
        self.feeder.heed(paused)
        self._notify()

    def stop(self) -> None:
        """First signal: stop reading; in-flight photos finish within the grace period."""
        self.stopping.set()
        self._notify()

    def _background_ready(self) -> bool:
        return self.gate.is_open() and not self.stopping.is_set()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """For /readyz: ready, else which dependency is down and why, or stopping."""
        down = dict(self.gate.down)
        ok = not self.stopping.is_set() and not down
        return ok, {"ready": ok, "stopping": self.stopping.is_set(), "down": down}

    async def run(self, *, drain: bool = False) -> None:
        async with self.renderer, anyio.create_task_group() as services:
            services.start_soon(self._heartbeat_loop, "heartbeat failed", self._refresh_entries)
            services.start_soon(self._heartbeat_loop, "renewing leases failed", self._renew_leases)
            services.start_soon(self._sweep_loop)
            services.start_soon(recorder.prune_forever, self.pool, self.settings.history_keep_days,
                                self.prune_duty, self._background_ready)  # fmt: skip
            services.start_soon(self.relay.run)
            services.start_soon(self.feeder.run)
            services.start_soon(self.pause_watch.run)
            services.start_soon(self.late_spans.run)
            if drain:
                services.start_soon(self._end_drain_in_outage)
            async with anyio.create_task_group() as jobs:
                await self._intake(jobs, drain)
                with anyio.move_on_after(self.settings.shutdown_grace_s):
                    await self._wait(lambda: not self.in_flight)
                if self.in_flight:
                    log.warning("grace period over; left pending", entries=self.in_flight.ids())
                jobs.cancel_scope.cancel()
            with anyio.move_on_after(RELAY_FLUSH_S):  # after the last outcome committed
                await self.relay.flush()
            await self.late_spans.final()
            services.cancel_scope.cancel()

    # -- intake ---------------------------------------------------------------------------

    async def _intake(self, jobs: TaskGroup, drain: bool) -> None:
        """Read until stopped (or drained); an outage pauses it, never ends it, and a
        failing step is retried with capped backoff, never at once."""
        started, backoff, throttle = False, Backoff(), Throttle(REPEAT_LOG_EVERY_S)
        while not self.stopping.is_set():
            try:
                if not started:
                    # The database's probe names a missing grant or a schema older or newer
                    # than the code before any photo meets it (an outage until fixed).
                    await self.gate.wait("database")
                    await self.streams.ensure_group()
                    await self.streams.join()  # the feeder sizes its reserve from us now
                    # Only at start: later, what this consumer holds is in flight or backing
                    # off. Once claimed (a delivery counted), never claimed again here.
                    for view in self.streams.lanes():
                        own = await view.read_own_pending(self.in_flight.free())
                        await self._dispatch(jobs, own)
                    started = True
                if await self._intake_step(jobs, drain):
                    return
                backoff.reset()
                throttle.clear()
            except Exception as exc:  # a bug must not end the worker either: back off
                await self._after_failure(exc, backoff, throttle)

    async def _after_failure(self, exc: Exception, backoff: Backoff, throttle: Throttle) -> None:
        if not isinstance(exc, DarkroomError):
            log.exception("intake failed unexpectedly")
            await self.clock.sleep(backoff.next_s(), self.stopping)
            return
        self._say_repeat(throttle, "intake call failed", exc)
        try:
            await self._recover(exc, backoff)
        except Exception:
            log.exception("recovering the intake failed")
            await self.clock.sleep(backoff.next_s(), self.stopping)

    async def _recover(self, exc: DarkroomError, backoff: Backoff) -> None:
        """Wait out an outage, or back off when the dependency answers its probe (the call
        failed for another reason); then re-create the group (Redis may have restarted
        empty) and refresh in-flight entries at once, before other consumers see them idle."""
        if exc.stage in DEPENDENCIES and await self.gate.wait(exc.stage):
            backoff.reset()
        else:
            await self.clock.sleep(backoff.next_s(), self.stopping)
        with contextlib.suppress(DarkroomError):
            await self.streams.ensure_group()
            await self.streams.join()
            await self._refresh_entries()

    async def _intake_step(self, jobs: TaskGroup, drain: bool) -> bool:
        """Reclaim and read once into the free places; True once drained."""
        await self._wait(
            lambda: (self.in_flight.free() > 0 and self.gate.is_open()) or self.stopping.is_set()
        )
        if self.stopping.is_set():
            return False
        if self.clock.now() >= self._next_reclaim:
            await self._reclaim(jobs)
            self._next_reclaim = self.clock.now() + RECLAIM_EVERY_S
            if self.in_flight.free() == 0:
                return False
        entries = await self._read_new(drain, jobs)
        await self._dispatch(jobs, entries, fresh=True)
        await self._say_taken(entries)
        return drain and not entries and await self._drained()

    async def _drained(self) -> bool:
        """Nothing in flight, pending or unread in either lane's stream (an entry the feeder
        fed is not yet delivered while bulk has no room in the read), nothing left for the
        feeder, and Postgres knows of no lost photo to re-enqueue. A final sweep that keeps
        failing ends the drain as failed (exit non-zero)."""
        if self.in_flight or await self.streams.pending_count() or await self._unread():
            return False
        if await intake.has_unfed(self.pool, self.settings.pg_intake):
            return False
        if self.sweep_duty.tenure is not None:
            # The sweep loop is in a pass: this one would be skipped and count as nothing
            # found, while that pass may be handing a lost photo back to the feeder.
            return False
        try:
            swept = await self._sweep()
        except DarkroomError as exc:
            self._drain_sweep_failures += 1
            if self._drain_sweep_failures < DRAIN_SWEEP_TRIES:
                raise
            self.drain_failed = exc
            log.error("final sweep failed; drain incomplete", error_code=exc.code, error=str(exc))
            return True
        self._drain_sweep_failures = 0
        return not swept

    async def _unread(self) -> int:
        return sum([await view.undelivered() for view in self.streams.lanes()])

    async def _end_drain_in_outage(self) -> None:
        while not self.stopping.is_set():
            with anyio.move_on_after(1.0):  # real time: a test's clock counts intake's waits
                await self.stopping.wait()
            outage = self.gate.lasting(DRAIN_OUTAGE_S)
            if outage is not None and not self.stopping.is_set():
                self.drain_outage = outage
                log.error("outage outlasted the drain; stopping with work left pending",
                          outage=outage, drain_outage_s=DRAIN_OUTAGE_S)  # fmt: skip
                self.stop()

    async def _reclaim(self, jobs: TaskGroup) -> None:
        """Each lane's stream with its own cursor, into that lane's room."""
        for view in self.streams.lanes():
            room = self._room(view.lane)
            if room:
                await self._reclaim_lane(jobs, view, room)

    async def _reclaim_lane(self, jobs: TaskGroup, view: Streams, room: int) -> None:
        entries, deleted = await view.reclaim(self.settings.claim_idle_ms, room)
        metrics.RECLAIMED.inc(len(entries))
        await self._dispatch(jobs, entries)
        if deleted:
            # XAUTOCLAIM has already dropped these from the PEL: if this fails, the sweep
            # finds the photos later.
            metrics.DELETED_WHILE_PENDING.inc(len(deleted))
            try:
                photos = await sweeper.requeue_deleted(self.pool, view, deleted)
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
            if not self.in_flight.admit(entry.id, entry.lane):
                # Our own entry, reclaimed because it looked idle (a heartbeat lost in an
                # outage): it is being worked on already; never run it twice at once.
                log.info("reclaimed an entry already in flight; not started twice",
                         entry_id=entry.id)  # fmt: skip
                continue
            metrics.IN_FLIGHT.set(len(self.in_flight))
            jobs.start_soon(self._run_one, entry, 1 if fresh else await self._deliveries(entry))

    async def _deliveries(self, entry: Entry) -> int:
        """The delivery count of a claimed entry. The claim already counted a delivery, so
        a Redis blip here must not leave it unstarted (it would cost another one): start it
        with 2, a lower bound for a reclaimed entry; the cap sees the true count next time."""
        try:
            return await self.streams.for_lane(entry.lane).deliveries(entry.id)
        except DarkroomError as exc:
            log.warning("delivery count unknown; starting with a lower bound",
                        entry_id=entry.id, error=str(exc))  # fmt: skip
            return 2

    async def _run_one(self, entry: Entry, deliveries: int) -> None:
        try:
            await self.jobs.handle(entry, deliveries)
        finally:
            self.in_flight.release(entry.id)
            metrics.IN_FLIGHT.set(len(self.in_flight))
            self._notify()

    async def _wait(self, condition: Callable[[], bool]) -> None:
        while not condition():
            with anyio.move_on_after(1):  # the gate reopens without a notification
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _say_repeat(self, throttle: Throttle, event: str, exc: DarkroomError) -> None:
        quiet = throttle.allow(f"{exc.code}:{exc.reason}", self.clock.now())
        if quiet is not None:
            log.warning(event, error_code=exc.code, reason=exc.reason, error=str(exc),
                        repeats_not_logged=quiet)  # fmt: skip

    # -- background loops -------------------------------------------------------------------

    async def _heartbeat_loop(self, failed: str, beat: Callable[[], Awaitable[None]]) -> None:
        """One heartbeat: of the in-flight entries in the stream (no other consumer steals a
        slow photo) or of their jobs' leases in PostgreSQL (one that reclaimed an entry all
        the same, after a Redis outage, finds the owner alive and counts nothing). Two
        loops: a hung Redis must not stop the leases, nor a hung database the entries."""
        period_s = policy.heartbeat_s(self.settings.claim_idle_ms)
        throttle = Throttle(REPEAT_LOG_EVERY_S)
        while True:
            await anyio.sleep(period_s)
            await self._beat(failed, throttle, beat)

    async def _beat(
        self, failed: str, throttle: Throttle, beat: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await beat()
        except DarkroomError as exc:
            self._say_repeat(throttle, failed, exc)
            return
        except Exception:  # a bug must not end the worker: the next beat tries again
            log.exception(f"{failed} unexpectedly")
            return
        throttle.clear()

    async def _refresh_entries(self) -> None:
        for view in self.streams.lanes():
            ids = self.in_flight.heartbeat_ids(view.lane)
            kept = await view.heartbeat(ids)
            lost = [i for i in ids if i not in kept and i in self.in_flight]
            if lost:
                log.info("entries taken over by another consumer; not refreshed", entries=lost)

    async def _renew_leases(self) -> None:
        held = [(c.photo_id, c.token) for c in self.in_flight.young_claims() if c.token]
        await leases.renew_leases(self.pool, self.jobs.lease, held)

    async def _sweep_loop(self) -> None:
        period_s = max(1.0, min(self.settings.sweep_after_s / 2, 60.0))
        backoff = Backoff(period_s, 8 * period_s)
        delay_s = period_s
        while True:
            await anyio.sleep(delay_s)
            delay_s = period_s
            if self.gate.is_open() and not self.stopping.is_set():
                try:
                    await self._sweep()
                    backoff.reset()
                except DarkroomError:
                    delay_s = backoff.next_s()
                except Exception:  # a bug must not end the worker: the sweep backs off
                    log.exception("sweep failed unexpectedly")
                    delay_s = backoff.next_s()

    async def _sweep(self) -> int:
        """One pass; its failure is logged and raised (the loop backs off, a drain counts)."""
        try:
            photos = await sweeper.sweep(
                self.pool, self.streams, self.settings.sweep_after_s, self.sweep_duty
            )
        except DarkroomError as exc:
            log.warning("sweep failed", error_code=exc.code, reason=exc.reason, error=str(exc))
            raise
        if photos:
            metrics.REQUEUED.labels("sweep").inc(len(photos))
            log.warning("swept lost photos back into the stream", count=len(photos))
        return len(photos)
