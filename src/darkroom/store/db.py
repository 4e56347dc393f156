"""PostgreSQL through asyncpg: every SQL statement of darkroom, one function per query.

Each state change is one statement (so one implicit transaction) and conditional:
a stale or duplicate worker can never move a photo backwards, publish it twice or
change `processed_at` once set. Driver errors become DatabaseUnavailableError here.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from darkroom import errors
from darkroom.errors import PERMANENT, TRANSIENT, DatabaseUnavailableError, InternalError, Rule
from darkroom.store import keys
from darkroom.store.entries import appended

Pool = asyncpg.Pool
Connection = PoolConnectionProxy

D, T, P = DatabaseUnavailableError, TRANSIENT, PERMANENT
# What each PostgreSQL failure says about the server, first match wins. All but the last
# row are database errors (the gate probes: if the probe fails too, it is an outage and
# the photo keeps its delivery); a transient one never counts an attempt. Any other SQL
# error is a bug in darkroom's SQL: internal_error.
ERRORS: tuple[Rule, ...] = (
    Rule(asyncpg.ReadOnlySQLTransactionError, D, "read_only", T),  # 25006: failover, replica
    Rule(asyncpg.InvalidPasswordError, D, "auth", P),  # 28P01: rotated credentials
    Rule(asyncpg.InvalidAuthorizationSpecificationError, D, "auth", P),  # 28000
    Rule(asyncpg.InsufficientPrivilegeError, D, "permission_denied", P),  # 42501: revoked grant
    Rule(asyncpg.CannotConnectNowError, D, "starting_up", T),  # 57P03
    Rule((asyncpg.AdminShutdownError, asyncpg.CrashShutdownError), D, "shutdown", T),  # 57P01/2
    Rule(asyncpg.OperatorInterventionError, D, "terminated", T),  # pg_terminate_backend, cancel
    Rule(asyncpg.TooManyConnectionsError, D, "too_many_connections", T),  # 53300
    Rule(asyncpg.InsufficientResourcesError, D, "resources", T),  # 53xxx: disk full, memory
    Rule(asyncpg.InvalidCatalogNameError, D, "database_missing", P),  # 3D000
    Rule(asyncpg.UndefinedTableError, D, "schema_missing", P),  # 42P01: not migrated
    # 42703, 42883: a schema older or newer than the code (a column or function missing)
    Rule((asyncpg.UndefinedColumnError, asyncpg.UndefinedFunctionError), D, "schema_mismatch", P),
    Rule(asyncpg.TransactionRollbackError, D, "conflict", T),  # 40001 serialization, 40P01 deadlock
    Rule(TimeoutError, D, "timeout", T),  # before `connection`: a TimeoutError is an OSError
    Rule((asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError), D, "connection", T),
    # a pooled connection that got the server's FATAL (pg_terminate_backend, failover) but
    # not yet its EOF: "cannot switch to state 12; another operation is in progress"
    Rule(asyncpg.InternalClientError, D, "connection", T),
    Rule(asyncpg.PostgresError, InternalError, "sql", P),
)
translated = errors.translated(ERRORS)


class PooledConnection(asyncpg.Connection):
    """A pooled connection returned as it is: no reset statement on each release.

    asyncpg's default release runs `pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL` on every connection given back, one more round trip per statement here
    (4 of a photo's 12, docs/performance.md). darkroom leaves no session state on a
    pooled connection: LISTENs are on dedicated connections, settings are transaction
    local, and no session lock is taken on them. An open transaction
    is still rolled back (asyncpg always does that, reset query or not)."""

    def get_reset_query(self) -> str:
        return ""


@translated
async def connect(url: str, size: int) -> Pool:
    # min_size=0: the pool connects on first use, so a worker started during a database
    # outage runs, waits and resumes instead of exiting.
    pool = await asyncpg.create_pool(url, min_size=0, max_size=size, command_timeout=30,
                                     timeout=10, connection_class=PooledConnection)  # fmt: skip
    return pool


def schema_sql() -> str:
    return resources.files("darkroom.store").joinpath("schema.sql").read_text()


@translated
async def migrate(url: str) -> bool:
    """Create the database if missing, then apply schema.sql; True if it was created."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    maintenance = urlunsplit(parts._replace(path="/postgres"))
    created = False
    admin = await asyncpg.connect(maintenance, timeout=10)
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            try:
                await admin.execute(f'CREATE DATABASE "{name.replace(chr(34), "")}"')
                created = True
            except asyncpg.DuplicateDatabaseError:
                pass  # another migrate won the race
    finally:
        await admin.close()
    conn = await asyncpg.connect(url, timeout=10)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('darkroom:migrate'))")
            await _apply_schema(conn)
    finally:
        await conn.close()
    return created


# The digest of the schema last applied. A re-run of `migrate` on a current database reads
# it and touches nothing else: ALTER TABLE and CREATE INDEX take their locks on `photos`
# before finding there is nothing to do, so running them on every deploy would queue every
# claim and publish behind any open transaction. An upgrade waits at most LOCK_TIMEOUT for
# its locks, then fails with a clear error rather than queue behind a long transaction.
# Once granted, an upgrade that adds an index on `photos` holds writes while it builds, for
# a time that grows with the table: deploy such a release in a quiet window, or build the
# new index first with CREATE INDEX CONCURRENTLY (the migrate then finds it there).
MIGRATE_LOCK_TIMEOUT = "10s"


async def _apply_schema(conn: asyncpg.Connection) -> None:
    sql = schema_sql()
    digest = hashlib.sha256(sql.encode()).hexdigest()
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS darkroom_schema"
        " (sha256 text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    if await conn.fetchval("SELECT 1 FROM darkroom_schema WHERE sha256 = $1", digest):
        return
    await conn.execute(f"SET LOCAL lock_timeout = '{MIGRATE_LOCK_TIMEOUT}'")
    await conn.execute(sql)
    await conn.execute("INSERT INTO darkroom_schema (sha256) VALUES ($1)", digest)


@translated
async def insert_photo(pool: Pool, photo_id: uuid.UUID, original_key: str) -> None:
    await pool.execute(
        # enqueued_at: the caller XADDs it (a crash in between is the sweep's to find)
        "INSERT INTO photos (id, original_key, enqueued_at) VALUES ($1, $2, now())",
        photo_id,
        original_key,
    )


@translated
async def last_error(pool: Pool, photo_id: uuid.UUID) -> tuple[str | None, str | None]:
    row = await pool.fetchrow(
        "SELECT error_code, last_error FROM photo_jobs WHERE photo_id = $1 AND type = 'process'",
        photo_id,
    )
    return (row["error_code"], row["last_error"]) if row else (None, None)


@translated
async def photo_state(pool: Pool, photo_id: uuid.UUID) -> str | None:
    state: str | None = await pool.fetchval(
        "SELECT processing_state FROM photos WHERE id = $1", photo_id
    )
    return state


async def reconnect(pool: Pool) -> None:
    """Replace every connection on its next use: after a failover the old ones talk to a
    server that no longer accepts writes."""
    await pool.expire_connections()


# Photos not terminal whose last sign of progress is before $1, oldest first, one keyset
# page after ($3, $4). Served by photos_sweep_idx on (last_activity_at, id): the cost of a
# page does not grow with the backlog (no sort of every unfinished photo).
STALE_SQL = """
SELECT p.id, p.last_activity_at, j.stream_entry, p.lane, p.enqueued_at IS NULL AS unfed,
       (extract(epoch FROM p.last_activity_at) * 1000)::bigint AS last_activity_ms
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE p.processing_state IN ('uploaded', 'processing')
  AND p.last_activity_at < $1
  AND NOT (p.lane = 'bulk' AND p.enqueued_at IS NULL)  -- the feeder's backlog, not lost
  AND (p.last_activity_at, p.id) > ($3, $4)
ORDER BY p.last_activity_at, p.id
LIMIT $2
"""

Cursor = tuple[datetime, uuid.UUID]
FIRST_PAGE: Cursor = (datetime.min.replace(tzinfo=UTC), uuid.UUID(int=0))


@translated
async def sweep_horizon(conn: Pool | Connection, after_s: float) -> datetime:
    """The database's now() minus `after_s`: a pass looks only at activity before it."""
    horizon: datetime = await conn.fetchval("SELECT now() - make_interval(secs => $1)", after_s)
    return horizon


@translated
async def stale_photos(
    conn: Pool | Connection, before: datetime, limit: int, after: Cursor = FIRST_PAGE
) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(STALE_SQL, before, limit, *after)]


# Served by photo_jobs_stream_entry_idx.
ENTRIES_SQL = """
SELECT j.photo_id FROM photo_jobs j JOIN photos p ON p.id = j.photo_id
WHERE j.stream_entry = ANY($1::text[])
  AND p.processing_state IN ('uploaded', 'processing')
"""


@translated
async def photos_of_entries(pool: Pool, entry_ids: list[str]) -> list[uuid.UUID]:
    """Unfinished photos whose job was last delivered through one of these entries."""
    return [row["photo_id"] for row in await pool.fetch(ENTRIES_SQL, entry_ids)]


# What recording an enqueue does to a job row that exists (REQUEUED_SQL, FED_SQL).
REQUEUED_CONFLICT = """
ON CONFLICT (photo_id, type) DO UPDATE SET
    -- a finished job keeps the entry it finished through (a failure's dead letter is
    -- finished from that entry alone); retry/replay reset the job to pending first
    -- a job a live worker holds (its lease runs) stays its own: the new entry meets it as
    -- `busy` and waits, instead of rendering the photo beside it
    stream_entry = CASE WHEN j.state IN ('done', 'failed')
                             OR (j.state = 'active' AND j.lease_until > now())
                        THEN j.stream_entry ELSE EXCLUDED.stream_entry END,
    -- a worker may have claimed the new entry between the XADD and this statement: its
    -- active job stays active (else its retry record, which needs `active`, would be lost)
    state = CASE WHEN j.state IN ('done', 'failed')
                      OR (j.state = 'active' AND (j.stream_entry = EXCLUDED.stream_entry
                                                  OR j.lease_until > now()))
                 THEN j.state ELSE 'pending' END,
    updated_at = now()
"""
REQUEUED_SQL = (
    """
WITH photo AS (
    UPDATE photos SET last_activity_at = now(), enqueued_at = now() WHERE id = $1 RETURNING id
)
INSERT INTO photo_jobs AS j (photo_id, type, state, stream_entry)
SELECT id, 'process', 'pending', $2 FROM photo
"""
    + REQUEUED_CONFLICT
)
# The feeder's batch: REQUEUED_SQL for each (photo, entry) pair, in one statement. The
# workers' writers lock one photo each; `rerender --since` locks many, in scan order, so a
# re-render request over photos the feeder is feeding can deadlock with it: PostgreSQL
# aborts one (the feeder restarts its tenure, the fed photos may get a duplicate entry
# answered `busy` or `already`; the operator's command says so and is run again).
FED_SQL = (
    """
WITH photo AS (
    UPDATE photos p SET last_activity_at = now(), enqueued_at = now()
    FROM unnest($1::uuid[], $2::text[]) AS f(id, entry) WHERE p.id = f.id
    RETURNING p.id, f.entry
)
INSERT INTO photo_jobs AS j (photo_id, type, state, stream_entry)
SELECT id, 'process', 'pending', entry FROM photo ORDER BY id
"""
    + REQUEUED_CONFLICT
)


@translated
async def record_requeued(
    conn: Pool | Connection | asyncpg.Connection, photo_id: uuid.UUID, entry_id: str
) -> None:
    """Remember the entry a photo was last enqueued through (the sweeper checks it) and
    when (the feeder enqueues no photo whose `enqueued_at` is set)."""
    await conn.execute(REQUEUED_SQL, photo_id, entry_id)


@translated
async def record_fed(
    conn: Pool | Connection | asyncpg.Connection, photo_ids: list[uuid.UUID], entry_ids: list[str]
) -> None:
    """record_requeued of each photo with its entry, in one statement (the feeder's batch)."""
    await conn.execute(FED_SQL, photo_ids, entry_ids)


# The failed run's entry is noted dropped: a worker that read it before takes nothing from
# the new run, whose own entry (the retry's XADD, or the sweep's) takes the job. Should
# that entry still be pending (its dead letter never written), it is acked `already`.
RESET_SQL = f"""
WITH photo AS (
    UPDATE photos SET processing_state = 'uploaded', error_code = NULL, updated_at = now(),
        last_activity_at = now()
    WHERE id = $1 AND processing_state = 'processing_failed'
    RETURNING id
)
UPDATE photo_jobs j SET state = 'pending', finished_at = NULL, next_retry_at = NULL,
    run_offset = attempt, transient_since = NULL, updated_at = now(),
    dropped_entries = {appended("j.stream_entry")}
WHERE photo_id IN (SELECT id FROM photo) AND type = 'process'
RETURNING photo_id
"""


@translated
async def reset_failed(pool: Pool | Connection, photo_id: uuid.UUID) -> bool:
    """Operator retry: a failed photo becomes `uploaded` again; its attempt count goes on,
    and a new run starts (DARKROOM_MAX_ATTEMPTS more attempts)."""
    return await pool.fetchval(RESET_SQL, photo_id) is not None


# -- rendition objects no row references (the delete after a re-render, `darkroom gc`) ----

# The keys each photo's row references, and whether a delivery is working on it.
HELD_SQL = """
SELECT p.id,
       coalesce((SELECT array_agg(r->>'key') FROM jsonb_array_elements(p.renditions) r),
                '{}') AS keys,
       coalesce(j.state = 'active', false) AS busy
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE p.id = ANY($1::uuid[])
"""


def _held(row: Any) -> keys.Held:
    return keys.Held(frozenset(row["keys"]), bool(row["busy"]))


@translated
async def held_photos(pool: Pool, photo_ids: list[uuid.UUID]) -> dict[uuid.UUID, keys.Held]:
    """A first look, without locks (a photo absent here has no row)."""
    return {row["id"]: _held(row) for row in await pool.fetch(HELD_SQL, photo_ids)}


# The job, locked after its photo (the order every statement uses), by a statement of its
# own: its snapshot is taken once the photo's lock is granted, so it sees a claim that
# committed while HELD_SQL waited for that lock, which HELD_SQL's join (read as its
# snapshot saw it before the wait) does not.
HELD_JOB_SQL = """
SELECT state = 'active' FROM photo_jobs WHERE photo_id = $1 AND type = 'process' FOR UPDATE
"""


@contextlib.asynccontextmanager
async def hold_photo(pool: Pool, photo_id: uuid.UUID) -> AsyncIterator[keys.Held | None]:
    """The photo and its job read under their row locks, held until the block ends (None:
    no such photo). A claim or a publish of this photo waits for the block, so what is
    deleted inside it cannot be claimed, re-uploaded and committed in between."""
    with errors.map_exceptions(ERRORS):
        async with pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(HELD_SQL + " FOR UPDATE OF p", [photo_id])
            busy = row is not None and await conn.fetchval(HELD_JOB_SQL, photo_id)
            yield keys.Held(frozenset(row["keys"]), bool(busy)) if row is not None else None
