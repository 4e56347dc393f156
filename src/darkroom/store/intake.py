"""PostgreSQL for the feeder: the rows still to be enqueued (`enqueued_at IS NULL`, the
photo unfinished), the bulk backlog by tenant, and the LISTEN connection of the single
feeder (the holder of its duty, duty.py). Every query is served by a partial index of
schema.sql's feeder block, so its cost follows the page, not the backlog. Driver
errors become darkroom errors here.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

import anyio
import asyncpg

from darkroom import errors
from darkroom.store.db import ERRORS, Pool, translated
from darkroom.store.db import Connection as PooledConnection
from darkroom.store.duties import Fence, fenced

INTAKE_CHANNEL = "darkroom_intake"
EVENTS_CHANNEL = "darkroom_events"  # outbox.CHANNEL: every outcome's notice
CLOSE_TIMEOUT_S = 5.0
Connection = asyncpg.Connection
Notified = Callable[[str], None]

# Interactive rows nobody enqueued, created before $1 (the feeder's delivery horizon less
# the producer's grace, queue/horizon.py: a row that old whose producer XADDed it was
# claimed, and a claim sets enqueued_at), oldest first. photos_intake_idx.
# With them, interactive re-renders requested while one ran whose worker died before its
# XADD (the publish cleared enqueued_at; photos_rerender_due_idx), their update before $1
# too: the publishing worker XADDs after its commit, as a producer does after its insert.
# A re-render's claim leaves enqueued_at NULL (the photo stays processed while it renders),
# so one a live lease holds is left out: its render is the follow-up, not a second entry.
DUE_SQL = """
(SELECT id, created_at, extract(epoch FROM now() - created_at)::float8 AS age_s, traceparent
 FROM photos
 WHERE enqueued_at IS NULL AND lane = 'interactive'
   AND processing_state IN ('uploaded', 'processing')
   AND created_at < $1
 ORDER BY created_at, id
 LIMIT $2)
UNION ALL
(SELECT id, updated_at, extract(epoch FROM now() - updated_at)::float8, traceparent
 FROM photos
 WHERE enqueued_at IS NULL AND lane = 'interactive'
   AND processing_state = 'processed' AND rerender_requested_at IS NOT NULL
   AND updated_at < $1
   AND NOT EXISTS (SELECT 1 FROM photo_jobs j WHERE j.photo_id = photos.id
                   AND j.state = 'active' AND j.lease_until > now())
 ORDER BY updated_at, id
 LIMIT $2)
ORDER BY created_at, id
LIMIT $2
"""

# A bulk photo to feed is unfinished, or processed with a re-render requested: this one
# predicate in every bulk query, the same as the partial indexes' (schema.sql, the feeder block),
# so the planner uses them.
FEEDABLE = """(processing_state IN ('uploaded', 'processing')
       OR (processing_state = 'processed' AND rerender_requested_at IS NOT NULL))"""

# One tenant's oldest bulk photos still to feed. photos_bulk_backlog_idx.
BACKLOG_SQL = f"""
SELECT id, tenant, cost, traceparent FROM photos
WHERE enqueued_at IS NULL AND lane = 'bulk' AND {FEEDABLE}
  AND tenant = $1
ORDER BY created_at, id
LIMIT $2
"""

# The tenants with a bulk backlog after $1 (NULL: from the first), in order: a skip scan
# (one index probe per tenant) of photos_bulk_backlog_idx, never a read of every waiting photo.
TENANTS_SQL = f"""
WITH RECURSIVE t(tenant) AS (
    (SELECT tenant FROM photos
     WHERE enqueued_at IS NULL AND lane = 'bulk'
       AND {FEEDABLE}
       AND ($1::text IS NULL OR tenant > $1)
     ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT p.tenant FROM photos p
            WHERE p.enqueued_at IS NULL AND p.lane = 'bulk'
              AND {FEEDABLE}
              AND p.tenant > t.tenant
            ORDER BY p.tenant LIMIT 1)
    FROM t WHERE t.tenant IS NOT NULL
)
SELECT tenant FROM t WHERE tenant IS NOT NULL LIMIT $2
"""

# The tenants of notified rows that wait in the bulk backlog (primary key lookups).
NOTIFIED_SQL = f"""
SELECT DISTINCT tenant FROM photos
WHERE id = ANY($1::uuid[]) AND enqueued_at IS NULL AND lane = 'bulk'
  AND {FEEDABLE}
"""

# Bulk photos enqueued and not finished, by tenant. photos_bulk_in_flight_idx.
IN_FLIGHT_SQL = f"""
SELECT tenant, count(*)::int AS n FROM photos
WHERE enqueued_at IS NOT NULL AND lane = 'bulk' AND {FEEDABLE}
GROUP BY tenant
"""


# Anything the feeder has still to feed ($1: the intake of interactive rows is on). The
# drain's last check; each EXISTS is one probe of its partial index.
UNFED_SQL = f"""
SELECT EXISTS (SELECT 1 FROM photos
               WHERE enqueued_at IS NULL AND lane = 'bulk'
                 AND {FEEDABLE})
    OR ($1 AND EXISTS (SELECT 1 FROM photos
                       WHERE enqueued_at IS NULL AND lane = 'interactive'
                         AND processing_state IN ('uploaded', 'processing')))
    OR ($1 AND EXISTS (SELECT 1 FROM photos
                       WHERE enqueued_at IS NULL AND lane = 'interactive'
                         AND processing_state = 'processed'
                         AND rerender_requested_at IS NOT NULL))
"""

# Before the XADD: the job row exists, so a worker that reads the entry at once finds it to
# lock (a claim racing the insert of the job row by record_requeued answers `busy`, and
# the entry would wait DARKROOM_CLAIM_IDLE_MS).
# A photo with no row gets none (its entry is `skipped`). In the same statement, the trace
# context of the traced photos among them, which their entries carry (docs/tracing.md).
PREPARE_JOBS_SQL = """
WITH jobs AS (
    INSERT INTO photo_jobs (photo_id, type, state)
    SELECT id, 'process', 'pending' FROM photos WHERE id = ANY($1::uuid[])
    ON CONFLICT (photo_id, type) DO NOTHING
)
SELECT id, traceparent FROM photos WHERE id = ANY($1::uuid[]) AND traceparent IS NOT NULL
"""
# The feeder's, fenced ($2..$4, its duty): a feeder that lost its lease writes nothing and
# learns it here, before its XADD. Whether the fence held, whatever the insert did.
FED_JOBS_SQL = f"""
WITH fence AS (SELECT {fenced(2)} AS held),
jobs AS (
    INSERT INTO photo_jobs (photo_id, type, state)
    SELECT id, 'process', 'pending' FROM photos
    WHERE id = ANY($1::uuid[]) AND (SELECT held FROM fence)
    ON CONFLICT (photo_id, type) DO NOTHING
)
SELECT held FROM fence
"""


@translated
async def now(conn: Connection) -> datetime:
    """PostgreSQL's clock: the one `created_at` is written in."""
    return await conn.fetchval("SELECT now()")  # type: ignore[no-any-return]


@translated
async def due_interactive(
    conn: Connection, created_before: datetime, limit: int
) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(DUE_SQL, created_before, limit)]


@translated
async def backlog_page(conn: Connection, tenant: str, limit: int) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(BACKLOG_SQL, tenant, limit)]


@translated
async def backlogged_tenants(conn: Connection, after: str | None, limit: int) -> list[str]:
    """One page of the tenants with bulk photos to feed, after `after` (None: the first)."""
    return [r["tenant"] for r in await conn.fetch(TENANTS_SQL, after, limit)]


@translated
async def notified_tenants(conn: Connection, photo_ids: list[uuid.UUID]) -> list[str]:
    return [r["tenant"] for r in await conn.fetch(NOTIFIED_SQL, photo_ids)]


@translated
async def in_flight(conn: Connection) -> dict[str, int]:
    return {r["tenant"]: r["n"] for r in await conn.fetch(IN_FLIGHT_SQL)}


@translated
async def has_unfed(pool: Pool, interactive: bool) -> bool:
    """Whether a photo still waits for the feeder (interactive rows only if `interactive`)."""
    return bool(await pool.fetchval(UNFED_SQL, interactive))


@translated
async def prepare_jobs(
    conn: Pool | PooledConnection | Connection, photo_ids: list[uuid.UUID]
) -> dict[uuid.UUID, str]:
    """The job rows, before the XADD (the sweep's, an operator's enqueue); the traced
    photos' `traceparent`, by photo, for their entries."""
    return {r["id"]: r["traceparent"] for r in await conn.fetch(PREPARE_JOBS_SQL, photo_ids)}


@translated
async def prepare_fed_jobs(conn: Connection, photo_ids: list[uuid.UUID], fence: Fence) -> bool:
    """The feeder's job rows, before its XADD, under its duty's `fence`: False, with
    nothing written, when the duty is lost. Its batch knows its trace context already:
    the query that picked the rows read it."""
    return bool(await conn.fetchval(FED_JOBS_SQL, photo_ids, *fence.args))


# PostgreSQL 15 signals every session of the database that LISTENs, on any channel, at
# every NOTIFY, and an idle one reads it in a transaction of its own: each photo's event
# notice would cost the feeder's listener a transaction. So the listener is a connection
# of its own (the "ear"), which also hears the events channel to know how busy it is: past
# BUSY_NOTICES in a HEAR_S turn it stays inside a statement for HEAR_S, the notifications
# queue meanwhile and are read in one transaction when it ends; a quiet database's
# notifications (one insert now and then) are read as they come.
HEAR_S = 0.25
BUSY_NOTICES = 3


class _Turn:
    """The notifications the listener was delivered in its current turn, either channel."""

    def __init__(self, on_notify: Notified) -> None:
        self.heard, self.on_notify = 0, on_notify

    def intake(self, *args: Any) -> None:
        self.heard += 1
        self.on_notify(str(args[3]))

    def event(self, *_args: Any) -> None:
        self.heard += 1

    def busy(self) -> bool:
        """Whether the turn that ends was busy; a new one starts."""
        busy, self.heard = self.heard >= BUSY_NOTICES, 0
        return busy


@contextlib.asynccontextmanager
async def listening(url: str, on_notify: Notified) -> AsyncIterator[Connection]:
    """The feeder's dedicated connection, and its listener on the intake channel (a pooled
    one would lose its LISTEN when given back). Only the feeder's holder opens them
    (duty.py). A lost listener closes the connection: the feeder's next query fails."""
    with errors.map_exceptions(ERRORS):
        conn = await asyncpg.connect(url, timeout=10, command_timeout=30)
        try:
            ear = await asyncpg.connect(url, timeout=10, command_timeout=30)
            try:  # listening before the caller's first look: nothing falls between
                turn = _Turn(on_notify)
                await ear.add_listener(INTAKE_CHANNEL, turn.intake)
                await ear.add_listener(EVENTS_CHANNEL, turn.event)
                async with _hearing(ear, conn, turn):
                    yield conn
            finally:
                await _close(ear)
        finally:
            await _close(conn)


@contextlib.asynccontextmanager
async def _hearing(ear: Connection, conn: Connection, turn: _Turn) -> AsyncIterator[None]:
    """The ear's turns beside the caller; the caller's own error comes out as itself."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hear, ear, conn, turn)
            yield
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:  # _hear raises nothing: it is the caller's
            raise group.exceptions[0] from None
        raise


async def _hear(ear: Connection, conn: Connection, turn: _Turn) -> None:
    """The ear's turns. An ear the server closed (idle_session_timeout, an operator's
    pg_terminate_backend) raises nothing on a quiet turn: its loss is looked for on every
    turn and passed on to the feeder's connection, whose next query fails (a new tenure
    listens afresh) instead of the feeder going deaf for the rest of its tenure."""
    try:
        while not ear.is_closed():
            if turn.busy():  # the notifications wait for the statement's end: one read
                await ear.fetchval("SELECT pg_sleep($1)", HEAR_S)
            else:
                await anyio.sleep(HEAR_S)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        pass
    conn.terminate()


async def _close(conn: Connection) -> None:
    """Closing says goodbye to the server; one that stopped answering is not waited for."""
    with anyio.CancelScope(shield=True):
        try:
            await conn.close(timeout=CLOSE_TIMEOUT_S)
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn.terminate()
