"""The feeder: puts rows with `enqueued_at IS NULL` into their lane's stream. Interactive
rows (PostgreSQL-only producers) go to DARKROOM_STREAM once their producer's own XADD, had
there been one, would have been claimed (the delivery horizon, queue/horizon.py); bulk rows
go to the bulk stream in the scheduler's fair order, never more than DARKROOM_BULK_AHEAD
undelivered. One feeder at a time across all workers: the holder of the feeder's leased
duty (duty.py), which LISTENs on darkroom_intake on a dedicated connection while it holds it.

Ordering hazards: the job row before the XADD (a claim must find it to lock), written under
the duty's fence: a feeder that lost its lease learns it there and XADDs nothing; the XADD
before the row is marked fed: a feeder that dies in between leaves a duplicate entry
(harmless: its claim answers `busy` or `already`), never a lost photo. The mark is not
fenced: it records an XADD that happened, and refusing it would only feed the photo twice.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import anyio
import structlog

from darkroom import metrics
from darkroom.duty import Duty, Tenure
from darkroom.health import Clock, RealClock
from darkroom.queue.horizon import Horizon, Mark
from darkroom.queue.lanes import entry_tenant
from darkroom.queue.messages import task_fields
from darkroom.queue.scheduler import Pending, Refill, Scheduler
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db, duties, intake

log = structlog.get_logger("darkroom.feeder")

# A producer that inserts and XADDs does so within this of its row's created_at; the
# intake counts its entry among those XADDed before a mark only for rows this much older.
INTAKE_GRACE_MS = 250
# A delivered entry is claimed (enqueued_at set) within this of its delivery: a mark is used
# only this long after the group was first seen delivered past it.
CLAIM_GRACE_MS = 250
CATCH_UP_S = 2.0  # interactive rows whose notification nobody heard
TENANT_SCAN_S = 30.0  # bulk tenants whose notification nobody heard
BULK_POLL_S = 0.1  # how often the bulk stream's backlog is checked while tenants wait
PAGE = 500
TENANT_PAGE = 1_000
BACKLOG_PAGE = 8  # photos loaded per tenant at a time: the order is decided late
MAX_NOTIFIED = 10_000  # beyond this, the tenant scan finds them


@dataclass
class Feeder:
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

    def __post_init__(self) -> None:
        s = self.settings
        self.bulk = self.streams.for_lane("bulk")
        self.named = frozenset(dict(s.tenant_weights))
        self.scheduler = self._new_scheduler()
        self.duty = Duty(duties.FEEDER, self.pool, self.holder, s.duty_lease_s)

    def stop(self) -> None:
        """Stop feeding and give the duty up (the worker's stop sets the same event)."""
        self.stopping.set()
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
        async with intake.listening(self.settings.database_url, self._heard) as conn:
            log.info("feeding", pg_intake=self.settings.pg_intake, token=tenure.fence.token)
            await self._serve(conn, tenure)

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
            await self._feed_bulk(conn)
            await self._rest(next_catch_up)

    async def _rest(self, next_catch_up: float) -> None:
        until = min(next_catch_up, self._due_at or next_catch_up)
        if len(self.scheduler):
            until = min(until, self.clock.now() + BULK_POLL_S)
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
        """Every interactive row due, a page at a time."""
        created_before = await self._created_before(conn)
        if created_before is None:
            return
        while rows := await intake.due_interactive(conn, created_before, PAGE):
            for row in rows:
                if not await self._enqueue(conn, self.streams, row["id"], task_fields(row["id"])):
                    return
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
        self, conn: intake.Connection, streams: Streams, photo_id: uuid.UUID, fields: dict[str, str]
    ) -> bool:
        """Checked before each photo: locally (a process that was frozen stops here), then by
        the fenced job row; False: the duty is lost (its work is being cancelled), no XADD."""
        tenure = self._tenure
        assert tenure is not None  # set by _serve, the only way here
        if not tenure.live():
            return False
        if not await intake.prepare_jobs(conn, [photo_id], tenure.fence):
            tenure.lose("write_refused")
            return False
        entry_id = await streams.enqueue(fields)
        await db.record_requeued(conn, photo_id, entry_id)  # sets enqueued_at
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
        """Top the bulk stream up to DARKROOM_BULK_AHEAD undelivered entries, in fair order."""
        if not len(self.scheduler):
            return
        room = self.settings.bulk_ahead - await self.bulk.undelivered()
        if room <= 0:
            return
        if self.settings.tenant_max_in_flight:
            self.scheduler.settle(await intake.in_flight(conn))
        for _ in range(room):
            photo = await self._next_photo(conn)
            if photo is None:
                break
            fields = {**task_fields(photo.photo_id), "tenant": entry_tenant(photo.tenant)}
            if not await self._enqueue(conn, self.bulk, photo.photo_id, fields):
                return
            metrics.FED.labels("bulk").inc()
        metrics.BULK_TENANTS.set(len(self.scheduler))

    async def _next_photo(self, conn: intake.Connection) -> Pending | None:
        """The scheduler's next photo, loading tenants' pages as it asks. Each photo is fed
        before the next pick: a page is read only once the photos before it are marked."""
        while isinstance(choice := self.scheduler.next(), Refill):
            rows = await intake.backlog_page(conn, choice.tenant, BACKLOG_PAGE)
            self.scheduler.refill(
                choice.tenant, [Pending(r["id"], r["tenant"], r["cost"]) for r in rows]
            )
        return choice
