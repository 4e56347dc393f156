"""The events relay: photo_events rows (committed with the outcome they report) to the
events stream, in id order, at least once. One relay at a time: the holder of the relay's
leased duty (duty.py), listening on a dedicated connection; another worker takes over
within the lease when that one stops renewing it (dies, freezes, is cut off).

Ordering hazards: XADD only rows read after their commit (NOTIFY fires at commit, and the
scan sees committed rows only); mark a row published only after its XADD returned (killed in
between: it is sent again with the same `id`, consumers dedupe); on (re)connecting, catch up
before waiting, so nothing committed while no one listened is left behind. The lease is
checked before each batch and the mark is fenced: a relay that lost its duty stops at its
next batch (what it sent meanwhile is a resend, which consumers dedupe).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import anyio
import structlog

from darkroom import metrics
from darkroom.duty import Duty, Tenure
from darkroom.errors import DatabaseUnavailableError
from darkroom.queue.eventstream import EventStream
from darkroom.queue.streams import Client
from darkroom.settings import Settings
from darkroom.store import db, duties, outbox

log = structlog.get_logger("darkroom.relay")

BATCH = 500
# Between passes without a NOTIFY: the retention's pace, never the publishing's.
IDLE_PASS_S = 30.0
# Passes at most this often: the commits of a busy worker share one pass (one read, one
# XADD, one mark) instead of one pass each; a quiet queue's event still leaves at once.
# So a pass costs each photo less the faster photos come: at most 20 passes a second.
PASS_GAP_S = 0.05
# The retention's batches run on their own clock, not on every pass.
PRUNE_EVERY_S = 60.0
PRUNE_BATCH = 1000
PRUNE_BATCHES_PER_PASS = 10  # bounded work per pass; the next pass goes on


class Relay:
    def __init__(
        self, duty: Duty, database_url: str, stream: EventStream, source: str, keep_days: float
    ):
        self.duty, self.database_url, self.stream = duty, database_url, stream
        self.source, self.keep_s = source, keep_days * 86400
        self.holding = False
        self.passes = 0  # passes finished while holding the duty (flush waits for one)
        self._wake = anyio.Event()
        self._sent: list[int] = []  # XADDed, not yet marked
        self._pruned_at: float | None = None  # anyio's clock; None: at the first pass

    @classmethod
    def from_settings(cls, settings: Settings, client: Client, pool: db.Pool, holder: str) -> Relay:
        stream = EventStream(client, settings.events_stream, settings.events_maxlen)
        duty = Duty(duties.RELAY, pool, holder, settings.duty_lease_s)
        return cls(duty, settings.database_url, stream, settings.events_source_uri,
                   settings.events_keep_days)  # fmt: skip

    async def run(self) -> None:
        """Forever (a service task): relay while this worker holds the relay's duty; a
        failure drops the connection, gives the duty up and backs off (duty.py)."""
        await self.duty.run(self._session)

    async def _session(self, tenure: Tenure) -> None:
        async with outbox.listening(self.database_url, self._notified) as conn:
            self.holding = True
            metrics.EVENTS_RELAY.set(1)
            log.info("event relay started", token=tenure.fence.token)
            try:
                await self._relay(conn, tenure)
            finally:
                self.holding = False
                metrics.EVENTS_RELAY.set(0)

    async def _relay(self, conn: outbox.Conn, tenure: Tenure) -> None:
        while True:
            await self._pass(conn, tenure)
            await anyio.sleep(PASS_GAP_S)
            with anyio.move_on_after(IDLE_PASS_S):
                await self._wake.wait()
            if conn.is_closed():
                lost = "the relay's connection was lost"
                raise DatabaseUnavailableError(lost, reason="connection")

    async def _pass(self, conn: outbox.Conn, tenure: Tenure) -> None:
        self._wake = anyio.Event()  # a NOTIFY from now on asks for another pass
        while len(await self.relay_batch(conn, tenure)) == BATCH:
            pass
        if tenure.live():
            await self._prune(conn)
        self.passes += 1

    async def relay_batch(self, conn: outbox.Conn, tenure: Tenure) -> list[str]:
        """XADD one batch of unpublished events in id order, then mark them; entry ids.
        A batch sent but not marked (PostgreSQL failed in between) is marked first on the
        next try, not sent again: only a kill of this process sends a batch twice. Nothing
        once the duty is lost (its mark refused, or its lease past): the new holder sends
        what is unmarked."""
        if self._sent and not await self._mark(conn, tenure):
            return []
        if not tenure.live():
            return []
        events = await outbox.unpublished(conn, BATCH)
        documents = [json.dumps(outbox.envelope(e, self.source)) for e in events]
        entry_ids = await self.stream.append(documents)
        _observe(events)
        self._sent = [e.seq for e in events]
        if events and not await self._mark(conn, tenure):
            return []
        return entry_ids

    async def _mark(self, conn: outbox.Conn, tenure: Tenure) -> bool:
        """The fenced mark of what was sent; refused: the duty is lost."""
        marked = await outbox.mark_published(conn, self._sent, tenure.fence)
        self._sent = []
        if not marked:
            tenure.lose("write_refused")
        return marked

    async def _prune(self, conn: outbox.Conn) -> None:
        """A bounded number of batches; the next pass goes on while more are due."""
        now = anyio.current_time()
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = None
        for _ in range(PRUNE_BATCHES_PER_PASS):
            if await outbox.prune(conn, self.keep_s, PRUNE_BATCH) < PRUNE_BATCH:
                self._pruned_at = now
                return

    def _notified(self, payload: str | None) -> None:
        self._wake.set()

    async def flush(self) -> None:
        """If this process relays: return after a pass that started after this call (the
        worker's stop, so its last outcomes leave before it exits)."""
        if not self.holding:
            return
        target = self.passes + 2  # the pass under way may have read before our commits
        self._wake.set()
        while self.holding and self.passes < target:
            await anyio.sleep(0.02)
            self._wake.set()


def _observe(events: list[outbox.Event]) -> None:
    now = datetime.now(UTC)
    metrics.EVENTS_RELAYED.inc(len(events))
    for event in events:
        metrics.EVENTS_LAG_SECONDS.observe(max(0.0, (now - event.created_at).total_seconds()))
