"""The events relay: photo_events rows (committed with the outcome they report) to the
events stream, in id order, at least once. One relay at a time: the holder of the relay's
leased duty (duty.py), listening on a dedicated connection; another worker takes over
within the lease when that one stops renewing it (dies, freezes, is cut off).

Ordering hazards: XADD only rows read after their commit (NOTIFY fires at commit, and the
scan sees committed rows only); mark a row published only after its XADD returned (killed in
between: it is sent again with the same `id`, consumers dedupe); on (re)connecting, catch up
before waiting, so nothing committed while no one listened is left behind. The lease is
checked before each batch and the mark is fenced: a relay that lost its duty stops at its
next batch (what it sent meanwhile is a resend, which consumers dedupe). A batch's mark is
the statement that reads the next batch; while passes find events back to back the relay
does not listen, and on listening again it passes once more before it waits, so what
committed before its LISTEN is not left for the idle pass.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import anyio
import structlog

from darkroom import metrics
from darkroom.duty import Duty, Tenure
from darkroom.errors import DarkroomError, DatabaseUnavailableError
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
# Passes in a row that found events before the relay stops listening (it passes every
# PASS_GAP_S meanwhile): a lone photo's events cost no UNLISTEN/LISTEN, a stream of them
# no transaction per NOTIFY.
BUSY_PASSES = 2
# The retention's batches run on their own clock, not on every pass.
PRUNE_EVERY_S = 60.0
LEAVING_MARK_S = 2.0  # a stop waits this long at most for the last batch's mark
PRUNE_BATCH = 1000
PRUNE_BATCHES_PER_PASS = 10  # bounded work per pass; the next pass goes on


class Relay:
    def __init__(
        self, duty: Duty, database_url: str, stream: EventStream, source: str, keep_days: float
    ):
        self.duty, self.database_url, self.stream = duty, database_url, stream
        self.source, self.keep_s = source, keep_days * 86400
        self.holding = False
        self.listening = True  # the server side of the connection's LISTEN
        self._busy = 0  # passes in a row that found events
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
            self.holding, self.listening, self._busy = True, True, 0
            metrics.EVENTS_RELAY.set(1)
            log.info("event relay started", token=tenure.fence.token)
            try:
                await self._relay(conn, tenure)
            finally:
                await self._mark_on_leaving(conn, tenure)
                self.holding = False
                metrics.EVENTS_RELAY.set(0)

    async def _mark_on_leaving(self, conn: outbox.Conn, tenure: Tenure) -> None:
        """A stop cancels the relay between a batch's XADD and the next pass's mark: mark it
        now (briefly, shielded), so the next holder does not send it again. A connection
        already lost, or a refusal, leaves it to the next holder (at least once)."""
        if not self._sent or conn.is_closed() or not tenure.live():
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(LEAVING_MARK_S):
            try:
                await self.mark_sent(conn, tenure)
            except DarkroomError as exc:
                log.warning("could not mark the last batch sent", error_code=exc.code)

    async def _relay(self, conn: outbox.Conn, tenure: Tenure) -> None:
        while True:
            found = await self._pass(conn, tenure)
            if await self._listen_again(conn, found):
                continue  # the catch-up: what committed before the LISTEN heard nothing
            await anyio.sleep(PASS_GAP_S)
            if self.listening and not self._sent:
                with anyio.move_on_after(IDLE_PASS_S):
                    await self._wake.wait()
            if conn.is_closed():
                lost = "the relay's connection was lost"
                raise DatabaseUnavailableError(lost, reason="connection")

    async def _listen_again(self, conn: outbox.Conn, found: bool) -> bool:
        """Stop listening after BUSY_PASSES passes that each found events (the next pass
        comes after PASS_GAP_S anyway: a NOTIFY would only cost the server a transaction);
        listen again once a pass finds none. True: listening again, a pass is due now."""
        self._busy = self._busy + 1 if found else 0
        if self.listening and self._busy >= BUSY_PASSES:
            await outbox.listen(conn, False)
            self.listening = False
        elif not self.listening and not found:
            await outbox.listen(conn, True)
            self.listening = True
            return True
        return False

    async def _pass(self, conn: outbox.Conn, tenure: Tenure) -> bool:
        """Batches until one is short; whether any event was sent."""
        self._wake = anyio.Event()  # a NOTIFY from now on asks for another pass
        found = False
        while sent := len(await self.relay_batch(conn, tenure)):
            found = True
            if sent < BATCH:
                break
        if tenure.live():
            await self._prune(conn)
        self.passes += 1
        return found

    async def relay_batch(self, conn: outbox.Conn, tenure: Tenure) -> list[str]:
        """Mark what the last batch sent and read the next (one statement), then XADD it in
        id order; entry ids. Its mark waits for the next batch: a busy relay costs one
        transaction per pass. A batch sent but not marked (PostgreSQL failed in between, or
        this is the last) is marked by the next try: only a kill of this process sends a
        batch twice. Nothing once the duty is lost (its mark refused, or its lease past):
        the new holder sends what is unmarked."""
        if not tenure.live():
            return []
        if self._sent:
            events = await outbox.mark_and_read(conn, self._sent, BATCH, tenure.fence)
            if events is None:
                self._lost(tenure)
                return []
        else:
            events = await outbox.unpublished(conn, BATCH)
        self._sent = []
        documents = [json.dumps(outbox.envelope(e, self.source)) for e in events]
        entry_ids = await self.stream.append(documents)
        _observe(events)
        self._sent = [e.seq for e in events]
        return entry_ids

    async def mark_sent(self, conn: outbox.Conn, tenure: Tenure) -> bool:
        """The fenced mark of what was sent, without reading on; refused: the duty is lost."""
        if self._sent and not await outbox.mark_published(conn, self._sent, tenure.fence):
            self._lost(tenure)
            return False
        self._sent = []
        return True

    def _lost(self, tenure: Tenure) -> None:
        self._sent = []  # the new holder sends what is unmarked
        tenure.lose("write_refused")  # says so, and stops the relay

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
        """If this process relays: return once what committed before this call is sent and
        marked (the worker's stop, so its last outcomes leave before it exits)."""
        if not self.holding:
            return
        target = self.passes + 2  # the pass under way may have read before our commits
        self._wake.set()
        while self.holding and self._flushing(target):
            await anyio.sleep(0.02)
            self._wake.set()

    def _flushing(self, target: int) -> bool:
        """Until the target pass sent our outcomes and the pass after it marked them (the
        next pass marks what one sent; others' outcomes that keep coming are not waited for)."""
        return self.passes < target or (bool(self._sent) and self.passes < target + 1)


def _observe(events: list[outbox.Event]) -> None:
    now = datetime.now(UTC)
    metrics.EVENTS_RELAYED.inc(len(events))
    for event in events:
        metrics.EVENTS_LAG_SECONDS.observe(max(0.0, (now - event.created_at).total_seconds()))
