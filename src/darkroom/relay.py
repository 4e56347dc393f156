"""The events relay: photo_events rows (committed with the outcome they report) to the
events stream, in id order, at least once. One relay at a time: the worker holding a session
advisory lock on its dedicated LISTEN connection; another takes over when that one dies.

Ordering hazards: XADD only rows read after their commit (NOTIFY fires at commit, and the
scan sees committed rows only); mark a row published only after its XADD returned (killed in
between: it is sent again with the same `id`, consumers dedupe); on (re)connecting, catch up
before waiting, so nothing committed while no one listened is left behind.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import anyio
import structlog

from darkroom import metrics
from darkroom.errors import DarkroomError, DatabaseUnavailableError
from darkroom.queue.eventstream import EventStream
from darkroom.queue.pacing import Backoff, Throttle
from darkroom.queue.streams import Client
from darkroom.settings import Settings
from darkroom.store import outbox

log = structlog.get_logger("darkroom.relay")

BATCH = 500
# Between passes without a NOTIFY: the retention's pace, never the publishing's.
IDLE_PASS_S = 30.0
# How often a worker without the lock asks for it (how soon it takes over a dead relay).
TAKEOVER_S = 2.0
# Passes at most this often: the commits of a busy worker share one pass (one read, one
# XADD, one mark) instead of one pass each; a quiet queue's event still leaves at once.
PASS_GAP_S = 0.05
# The retention's batches run on their own clock, not on every pass.
PRUNE_EVERY_S = 60.0
PRUNE_BATCH = 1000
PRUNE_BATCHES_PER_PASS = 10  # bounded work per pass; the next pass goes on
REPEAT_LOG_EVERY_S = 10.0


class Relay:
    def __init__(self, database_url: str, stream: EventStream, source: str, keep_days: float):
        self.database_url, self.stream, self.source = database_url, stream, source
        self.keep_s = keep_days * 86400
        self.holding = False
        self.passes = 0  # passes finished while holding the lock (flush waits for one)
        self._wake = anyio.Event()
        self._sent: list[int] = []  # XADDed, not yet marked
        self._pruned_at: float | None = None  # anyio's clock; None: at the first pass

    @classmethod
    def from_settings(cls, settings: Settings, client: Client) -> Relay:
        stream = EventStream(client, settings.events_stream, settings.events_maxlen)
        return cls(settings.database_url, stream, settings.events_source_uri,
                   settings.events_keep_days)  # fmt: skip

    async def run(self) -> None:
        """Forever (a service task): take the lock when free, then relay until a failure,
        which drops the connection and its lock, backs off and starts again."""
        backoff, throttle = Backoff(), Throttle(REPEAT_LOG_EVERY_S)
        while True:
            try:
                await self._session()
                backoff.reset()
                throttle.clear()
            except DarkroomError as exc:
                quiet = throttle.allow(f"{exc.code}:{exc.reason}", anyio.current_time())
                if quiet is not None:
                    log.warning("event relay failed", error_code=exc.code, error=str(exc),
                                repeats_not_logged=quiet)  # fmt: skip
                await anyio.sleep(backoff.next_s())
            except Exception:  # a bug must not end the worker: the relay backs off
                log.exception("event relay failed unexpectedly")
                await anyio.sleep(backoff.next_s())
            finally:
                self.holding = False
                metrics.EVENTS_RELAY.set(0)

    async def _session(self) -> None:
        async with outbox.listening(self.database_url, self._notified) as conn:
            await self._lock(conn)
            self.holding = True
            metrics.EVENTS_RELAY.set(1)
            log.info("event relay started")
            while True:
                await self._pass(conn)
                await anyio.sleep(PASS_GAP_S)
                with anyio.move_on_after(IDLE_PASS_S):
                    await self._wake.wait()
                if conn.is_closed():
                    raise DatabaseUnavailableError(
                        "the relay's connection was lost", reason="connection"
                    )

    async def _lock(self, conn: outbox.Conn) -> None:
        """Wait for the relay's lock, asking on this one connection every TAKEOVER_S."""
        while True:
            if await outbox.try_lock(conn):
                return
            await anyio.sleep(TAKEOVER_S)

    async def _pass(self, conn: outbox.Conn) -> None:
        self._wake = anyio.Event()  # a NOTIFY from now on asks for another pass
        while len(await self.relay_batch(conn)) == BATCH:
            pass
        await self._prune(conn)
        self.passes += 1

    async def relay_batch(self, conn: outbox.Conn) -> list[str]:
        """XADD one batch of unpublished events in id order, then mark them; entry ids.
        A batch sent but not marked (PostgreSQL failed in between) is marked first on the
        next try, not sent again: only a kill of this process sends a batch twice."""
        if self._sent:
            await outbox.mark_published(conn, self._sent)
            self._sent = []
        events = await outbox.unpublished(conn, BATCH)
        documents = [json.dumps(outbox.envelope(e, self.source)) for e in events]
        entry_ids = await self.stream.append(documents)
        _observe(events)
        self._sent = [e.seq for e in events]
        if events:
            await outbox.mark_published(conn, self._sent)
            self._sent = []
        return entry_ids

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
