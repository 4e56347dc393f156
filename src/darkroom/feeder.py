"""The feeder: puts rows with `enqueued_at IS NULL` into their lane's stream. Interactive
rows (PostgreSQL-only producers) go to DARKROOM_STREAM once their producer's own XADD, had
there been one, would have been claimed (the delivery horizon, queue/horizon.py); bulk rows
go to the bulk stream in the scheduler's fair order, as a standing reserve of undelivered
entries (DARKROOM_BULK_AHEAD, or every live worker's regular places) topped up in one batch
once workers say they took half of it. One feeder at a time across all workers: the holder
of the feeder's leased duty (duty.py), which LISTENs on darkroom_intake on a dedicated
connection while it holds it. A tenant over its rate (limiting.py, mixed in) is charged
as its photos are XADDed, once per batch, and held out of the fair order until its bucket
has room: the other tenants take its turns.

Ordering hazards, for each batch: the job rows before the XADDs (a claim must find them to
lock), written under the duty's fence: a feeder that lost its lease learns it there and
XADDs nothing; the XADDs before the rows are marked fed: a feeder that dies in between
leaves duplicate entries (harmless: their claims answer `busy` or `already`), never a lost
photo. The mark is not fenced: it records XADDs that happened, and refusing it would only
feed the photos twice.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio
import structlog

from darkroom import metrics
from darkroom.duty import Duty, Tenure
from darkroom.errors import DarkroomError
from darkroom.health import Clock, RealClock
from darkroom.limiting import RateLimits
from darkroom.queue.buckets import Buckets
from darkroom.queue.horizon import INTAKE_GRACE_MS, Horizon, Mark
from darkroom.queue.lanes import entry_tenant
from darkroom.queue.limits import Rate, Throttle
from darkroom.queue.messages import task_fields
from darkroom.queue.pauses import Paused
from darkroom.queue.reserve import Reserve
from darkroom.queue.scheduler import Pending, Scheduler
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db, duties, intake

log = structlog.get_logger("darkroom.feeder")

# A delivered entry is claimed (enqueued_at set) within this of its delivery: a mark is used
# only this long after the group was first seen delivered past it.
CLAIM_GRACE_MS = 250
CATCH_UP_S = 2.0  # interactive rows whose notification nobody heard
TENANT_SCAN_S = 30.0  # bulk tenants whose notification nobody heard
# Workers say when they take bulk entries (Streams.say_taken) and the feeder looks at the
# reserve at once; this poll is only the backstop for a word lost.
BULK_POLL_S = 0.5
TAKEN_BLOCK_MS = 1_000
# The reserve (DARKROOM_BULK_AHEAD 0): the live bulk consumers are counted this often, and a
# consumer seen (a read, a claim, a heartbeat) within LIVE_CONSUMER_MS counts.
RESERVE_EVERY_S = 2.0
LIVE_CONSUMER_MS = 60_000
PAGE = 500
TENANT_PAGE = 1_000
BACKLOG_PAGE = 8  # photos loaded per tenant at a time: the order is decided late
MAX_NOTIFIED = 10_000  # beyond this, the tenant scan finds them
# How soon `darkroom limits set/clear` takes effect: the limits are one small table.
LIMITS_EVERY_S = 2.0

Fields = dict[str, str]


@dataclass
class Feeder(RateLimits):
    settings: Settings
    pool: db.Pool
    streams: Streams
    stopping: anyio.Event
    holder: str
    clock: Clock = field(default_factory=RealClock)
    _notified: set[uuid.UUID] = field(default_factory=set)
    _due_at: float | None = None
    _woken: anyio.Event = field(default_factory=anyio.Event)
    _tenure: Tenure | None = None  # this worker's holding of the duty, while it feeds
    horizon: Horizon = field(default_factory=lambda: Horizon(CLAIM_GRACE_MS / 1000))
    _notice: float | None = None  # the newest notification not yet behind the horizon
    _bulk_due: bool = False  # a worker took bulk entries since the last top-up
    _places: int = 0
    _places_at: float = float("-inf")
    reserve: Reserve = field(default_factory=Reserve)
    _limits_at: float = float("-inf")
    _uploads_after: datetime | None = None  # interactive uploads charged up to here
    _owed: set[str] = field(default_factory=set)  # released, not yet fed since
    paused: Paused = field(default_factory=Paused)  # the worker's copy (pausing.py)

    def __post_init__(self) -> None:
        s = self.settings
        self.bulk = self.streams.for_lane("bulk")
        self.throttle = Throttle(Rate(s.tenant_rate, s.tenant_burst))
        self.buckets = Buckets(self.streams.client, self.bulk.stream)
        self.named = frozenset(dict(s.tenant_weights))
        self.scheduler = self._new_scheduler()
        self.duty = Duty(duties.FEEDER, self.pool, self.holder, s.duty_lease_s)

    def stop(self) -> None:
        """Stop feeding and give the duty up (the worker's stop sets the same event)."""
        self.stopping.set()
        self._woken.set()

    def heed(self, paused: Paused) -> None:
        """The pauses changed: a resumed tenant or lane is fed at once, not at the poll."""
        self.paused = paused
        self._bulk_due = True
        self._woken.set()

    def _new_scheduler(self) -> Scheduler:
        s = self.settings
        return Scheduler(dict(s.tenant_weights), s.tenant_max_in_flight)

    async def run(self) -> None:
        """Until stopped: feed while this worker holds the feeder's duty (a failure gives
        it up and backs off: duty.py)."""
        await self.duty.run(self._feed, self.stopping)

    async def _feed(self, tenure: Tenure) -> None:
        # A takeover knows nothing delivered yet; rows nobody heard about get a prompt look.
        self.horizon, self._notice = Horizon(CLAIM_GRACE_MS / 1000), self.clock.now()
        async with (
            intake.listening(self.settings.database_url, self._heard) as conn,
            anyio.create_task_group() as beside,
        ):
            beside.start_soon(self._watch_taken)
            log.info("feeding", pg_intake=self.settings.pg_intake, token=tenure.fence.token)
            await self._serve(conn, tenure)
            beside.cancel_scope.cancel()

    async def _watch_taken(self) -> None:
        """Wake the feeding whenever a worker says it took bulk entries (a plain XREAD:
        cancelling it loses nothing)."""
        after = "$"
        while True:
            try:
                seen = await self.bulk.wait_taken(after, TAKEN_BLOCK_MS)
            except DarkroomError:
                await anyio.sleep(BULK_POLL_S)  # the poll feeds meanwhile
                continue
            if seen != after:
                after, self._bulk_due = seen, True
                self._woken.set()

    def _heard(self, payload: str) -> None:
        """A committed insert: due after the grace (its producer may XADD it meanwhile)."""
        try:
            photo_id = uuid.UUID(payload)
        except ValueError:
            return
        if len(self._notified) < MAX_NOTIFIED:
            self._notified.add(photo_id)
        self._notice = self.clock.now()
        if self._due_at is None:
            self._due_at = self.clock.now() + INTAKE_GRACE_MS / 1000
            self._woken.set()

    async def _serve(self, conn: intake.Connection, tenure: Tenure) -> None:
        """State is rebuilt from PostgreSQL on every takeover: a dead feeder's is lost."""
        self.scheduler = self._new_scheduler()
        self.throttle.release_all()
        self._limits_at, self._uploads_after = float("-inf"), None
        self.reserve = Reserve()
        self._tenure = tenure
        await self.bulk.ensure_group()
        next_catch_up = next_scan = self.clock.now()
        while not self.stopping.is_set() and tenure.live():
            now = self.clock.now()
            if now >= next_scan:
                await self._scan_tenants(conn)
                next_scan = now + TENANT_SCAN_S
            if now >= next_catch_up or (self._due_at is not None and now >= self._due_at):
                await self._take_notified(conn)
                next_catch_up = now + CATCH_UP_S
            if now >= self._limits_at:
                await self.load_limits(conn)
                await self.charge_interactive(conn)
                self._limits_at = now + LIMITS_EVERY_S
            await self._feed_bulk(conn)
            await self._rest(next_catch_up)

    async def _rest(self, next_catch_up: float) -> None:
        until = min(next_catch_up, self._due_at or next_catch_up)
        if len(self.scheduler):
            until = min(until, self.clock.now() + (0 if self._bulk_due else BULK_POLL_S))
        # A held tenant's release is due only where the lane is fed: while the bulk lane is
        # paused no release runs, and a past `held_until` would turn this rest into a spin.
        held_until = None if self.paused.lane("bulk") else self.throttle.next_due()
        if held_until is not None:
            until = min(until, held_until)
        self._woken = anyio.Event()
        if self.stopping.is_set():
            return
        with anyio.move_on_after(max(0.0, until - self.clock.now())):
            await self._woken.wait()

    async def _take_notified(self, conn: intake.Connection) -> None:
        notified, self._notified, self._due_at = list(self._notified), set(), None
        if self.settings.pg_intake:
            await self._intake(conn)
        if notified:
            for tenant in await intake.notified_tenants(conn, notified):
                self.scheduler.add(tenant)

    # -- interactive: the PostgreSQL intake ---------------------------------------------

    async def _intake(self, conn: intake.Connection) -> None:
        """Every interactive row due, a page (one batch) at a time."""
        created_before = await self._created_before(conn)
        if created_before is None:
            return
        while rows := await intake.due_interactive(conn, created_before, PAGE):
            batch = [(row["id"], task_fields(row["id"], _context(row["traceparent"])))
                     for row in rows]  # fmt: skip
            if not await self._enqueue(conn, self.streams, batch):
                return
            for row in rows:
                metrics.INTAKE_LAG_SECONDS.observe(row["age_s"])
            metrics.FED.labels("interactive").inc(len(rows))
            log.info("enqueued rows nobody XADDed", count=len(rows))
            if len(rows) < PAGE or self.stopping.is_set():
                return

    async def _created_before(self, conn: intake.Connection) -> datetime | None:
        """A mark (PostgreSQL's clock, then the stream's last id), and the rows' bound from
        the newest usable one: older rows still NULL were never XADDed (None: no bound yet)."""
        taken_at = await intake.now(conn)
        last_id, undelivered = await self.streams.delivery_point()
        now = self.clock.now()
        self.horizon.observe(taken_at, last_id, undelivered, now)
        mark = self.horizon.bound(now)
        self._follow_up(mark, now)
        return None if mark is None else mark.taken_at - timedelta(milliseconds=INTAKE_GRACE_MS)

    def _follow_up(self, mark: Mark | None, now: float) -> None:
        """Notified rows behind no usable mark yet: look again when the next ripe mark is
        usable (on an idle queue, CLAIM_GRACE_MS from now), not at the next catch-up. A
        backlog ripens marks only as it is delivered: the catch-up looks every CATCH_UP_S."""
        if self._notice is None:
            return
        if mark is not None and mark.seen - INTAKE_GRACE_MS / 1000 > self._notice:
            self._notice = None
            return
        if (usable := self.horizon.next_usable(now)) is not None:
            self._due_at = usable if self._due_at is None else min(self._due_at, usable)

    async def _enqueue(
        self, conn: intake.Connection, streams: Streams, batch: list[tuple[uuid.UUID, Fields]]
    ) -> bool:
        """Checked before each batch: locally (a process that was frozen stops here), then
        by the fenced job rows; False: the duty is lost (its work is being cancelled), no
        XADD. Then the batch's XADDs (one round trip) and their marks (one statement). The
        fields carry each photo's trace context already: the pick's query read it."""
        tenure = self._tenure
        assert tenure is not None  # set by _serve, the only way here
        if not tenure.live():
            return False
        photo_ids = [photo_id for photo_id, _ in batch]
        if not await intake.prepare_fed_jobs(conn, photo_ids, tenure.fence):
            tenure.lose("write_refused")
            return False
        entry_ids = await streams.enqueue_many([fields for _, fields in batch])
        await db.record_fed(conn, photo_ids, entry_ids)  # sets enqueued_at
        return True

    # -- bulk: fair feeding ---------------------------------------------------------------

    async def _scan_tenants(self, conn: intake.Connection) -> None:
        after: str | None = None
        while page := await intake.backlogged_tenants(conn, after, TENANT_PAGE):
            for tenant in page:
                self.scheduler.add(tenant)
            after = page[-1]
        metrics.BULK_TENANTS.set(len(self.scheduler))

    async def _feed_bulk(self, conn: intake.Connection) -> None:
        """Top the bulk stream up to its reserve of undelivered entries, in fair order, in
        batches, once half of it was taken: a worker's places wait for a slot as well, so
        its render slots stay busy while the reserve is refilled."""
        self._bulk_due = False
        if not len(self.scheduler) or self.paused.lane("bulk"):
            return  # a paused lane gets nothing more to wait in its stream
        self.scheduler.hold(self.paused.tenants("bulk"))
        undelivered = await self.bulk.undelivered()
        self.reserve.look(self.clock.now(), undelivered)
        reserve = self.settings.bulk_ahead or self.reserve.size(await self._live_places())
        room = reserve - undelivered
        self._owed.update(self._released())
        if room < max(1, reserve // 2):
            if self._owed and room > 0:
                await self._feed_owed(conn, room)
            return  # half the reserve still waits: top up in batches, not photo by photo
        self._owed.clear()  # released to the ring's head: this top-up starts with them
        if self.settings.tenant_max_in_flight:
            self.scheduler.settle(await intake.in_flight(conn))
        while room > 0 and (picked := await self._pick(conn, room)):
            if not (picked := await self._within_rates(picked)):
                continue  # every tenant picked is held now: the others are picked next
            if not await self._feed_picked(conn, picked):
                return
            room -= len(picked)
        metrics.BULK_TENANTS.set(len(self.scheduler))

    async def _feed_picked(self, conn: intake.Connection, picked: list[Pending]) -> bool:
        batch = [(p.photo_id, {**task_fields(p.photo_id, _context(p.traceparent)),
                               "tenant": entry_tenant(p.tenant)}) for p in picked]  # fmt: skip
        if not await self._enqueue(conn, self.bulk, batch):
            return False
        self.reserve.fed(len(batch))
        metrics.FED.labels("bulk").inc(len(batch))
        return True

    async def _live_places(self) -> int:
        """As many entries as the live bulk consumers have regular places (this worker's
        count for each): every place that frees finds one. The reserve (queue/reserve.py)
        holds more when the workers take more in its time; DARKROOM_BULK_AHEAD overrides."""
        if self.clock.now() >= self._places_at:
            live = await self.bulk.live_consumers(LIVE_CONSUMER_MS)
            self._places = self.settings.in_flight_bound * max(1, live)
            self._places_at = self.clock.now() + RESERVE_EVERY_S
        return self._places

    async def _pick(self, conn: intake.Connection, most: int) -> list[Pending]:
        """Up to `most` photos in the scheduler's order, loading tenants' pages as it asks.
        It stops at a tenant to load whose photos it picked already: they are not marked
        fed yet, and its page would hold them again."""
        picked: list[Pending] = []
        tenants: set[str] = set()
        while len(picked) < most:
            choice = self.scheduler.next()
            if choice is None:
                break
            if isinstance(choice, Pending):
                picked.append(choice)
                tenants.add(choice.tenant)
                continue
            if choice.tenant in tenants:
                break
            rows = await intake.backlog_page(conn, choice.tenant, BACKLOG_PAGE)
            pending = [Pending(r["id"], r["tenant"], r["cost"], r["traceparent"]) for r in rows]
            self.scheduler.refill(choice.tenant, pending)
        return picked


def _context(traceparent: str | None) -> Fields:
    """A row's trace context as its entry's `carried` fields (task_fields keeps a valid one)."""
    return {"traceparent": traceparent} if traceparent else {}
