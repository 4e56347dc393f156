"""PostgreSQL through asyncpg: every SQL statement of darkroom, one function per query.

Each state change is one statement (so one implicit transaction) and conditional:
a stale or duplicate worker can never move a photo backwards, publish it twice or
change `processed_at` once set. Driver errors become DatabaseUnavailableError here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from darkroom import errors
from darkroom.errors import PERMANENT, TRANSIENT, DatabaseUnavailableError, InternalError, Rule
from darkroom.store import keys

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
    local, and `advisory_lock` unlocks or terminates its connection. An open transaction
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
# its locks, then fails with a clear error rather than stalling the workers.
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


Outcome = Literal["claimed", "already", "skipped", "busy", "exhausted"]
NO_PHOTO = uuid.UUID(int=0)


@dataclass(frozen=True)
class Claim:
    outcome: Outcome
    original_key: str = ""
    # This run's attempt number: of this claim (claimed), of the refused one (exhausted),
    # or the job's (busy).
    attempt: int = 0
    state: str = ""
    # For a photo that already failed: where and how (to finish an unwritten dead letter);
    # for a busy job: the entry it was claimed through.
    last_entry: str | None = None
    error_code: str | None = None
    last_error: str | None = None
    photo_id: uuid.UUID = NO_PHOTO
    counted: bool = False  # this claim counted an attempt (not a claim by its own holder)
    owner: str | None = None  # busy: the consumer whose live process holds the job
    history_row: int | None = None  # the delivery's `running` row in photo_attempts


# One statement. Lock the photo, then its job (so the job is read as it is now, not as the
# statement's snapshot saw it before the photo's lock was granted). A terminal photo
# (processed, or failed and not reset by a retry) is left alone: `already`. A job active
# under a live lease of another consumer's process (its owner lives; a Redis outage ate its
# heartbeat) is left alone too: `busy`, nothing counted. A claim by the job's own holder (a
# lost reply, a reclaim of its own entry) counts nothing; any other claim counts one
# attempt; past this run's attempts it is `exhausted`, and the job is taken all the same (it
# is this delivery that records the failure, and only a job's owner may: FAIL_SQL).
# Own means this process and this entry: another entry of a photo this process is working
# on (a duplicate XADD, e.g. a producer's and the intake's) is `busy`, never a second render.
# A job that is done or failed (a re-render, an operator retry) starts a new run. The photo
# becomes `processing`; a processed photo with a re-render requested stays processed.
# A claim sets `enqueued_at` if unset: the PostgreSQL intake never enqueues a photo again
# once a worker claimed it through its producer's own XADD.
CLAIM_SQL = """
WITH p AS (
    SELECT id, original_key, processing_state,
           processing_state IN ('processed', 'processing_failed')
           AND NOT (processing_state = 'processed' AND rerender_requested_at IS NOT NULL)
           AS finished,
           processing_state = 'processed' AS rerender
    FROM photos WHERE id = $1 FOR UPDATE
), prior AS (
    SELECT j.id, j.state, j.attempt, j.run_offset, j.stream_entry, j.consumer, j.error_code,
           j.last_error,
           j.state = 'active' AND j.holder = $4 AND j.stream_entry = $2 AS own,
           j.state = 'active' AND j.lease_until > now()
           AND ((j.holder IS DISTINCT FROM $4 AND j.consumer IS DISTINCT FROM $3)
                OR (j.holder = $4 AND j.stream_entry IS DISTINCT FROM $2)) AS held
    FROM photo_jobs j JOIN p ON j.photo_id = p.id
    WHERE j.type = 'process'
    FOR UPDATE OF j
), next AS (
    SELECT p.id AS photo_id, prior.id AS job_id, coalesce(prior.own, false) AS own,
           coalesce(prior.attempt, 0) + CASE WHEN prior.own THEN 0 ELSE 1 END AS attempt,
           CASE WHEN prior.state IN ('done', 'failed') THEN prior.attempt
                ELSE coalesce(prior.run_offset, 0) END AS run_offset
    FROM p LEFT JOIN prior ON true
    WHERE NOT p.finished AND NOT coalesce(prior.held, false)
), job AS (
    INSERT INTO photo_jobs AS j (id, photo_id, type, state, attempt, run_offset, stream_entry,
                                 consumer, holder, lease_until, started_at)
    SELECT coalesce(job_id, nextval(pg_get_serial_sequence('photo_jobs', 'id'))), photo_id,
           'process', 'active', attempt, run_offset, $2, $3, $4,
           now() + $5 * interval '1 millisecond', now()
    FROM next
    ON CONFLICT (photo_id, type) DO UPDATE SET
        state = 'active',
        attempt = EXCLUDED.attempt,
        run_offset = EXCLUDED.run_offset,
        stream_entry = EXCLUDED.stream_entry,
        consumer = EXCLUDED.consumer,
        holder = EXCLUDED.holder,
        lease_until = EXCLUDED.lease_until,
        started_at = now(),
        next_retry_at = NULL,
        updated_at = now()
    -- only the job locked in `prior`: one inserted meanwhile is another claim's
    WHERE j.id = EXCLUDED.id
    RETURNING attempt - run_offset AS run_attempt
), photo AS (
    UPDATE photos SET processing_state = 'processing', error_code = NULL, updated_at = now(),
        last_activity_at = now(), enqueued_at = coalesce(photos.enqueued_at, now())
    FROM p WHERE photos.id = p.id AND NOT p.rerender AND EXISTS (SELECT 1 FROM job)
), attempt_row AS (
    -- the delivery's `running` history row, in the claim's own commit ($7: its lane;
    -- NULL with DARKROOM_HISTORY=false). A claim by the job's own holder (its first reply
    -- was lost) has its row already: no second one, which would stay `running` for good.
    INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane)
    SELECT $1, $2, $3, $7 FROM job
    WHERE $7::text IS NOT NULL AND NOT (SELECT own FROM next)
    RETURNING id
), own_row AS (
    SELECT a.id FROM photo_attempts a
    WHERE a.photo_id = $1 AND a.entry_id = $2 AND a.consumer = $3 AND a.outcome = 'running'
      AND $7::text IS NOT NULL AND (SELECT own FROM next) AND EXISTS (SELECT 1 FROM job)
    ORDER BY a.id DESC LIMIT 1
)
SELECT p.original_key, p.finished, p.processing_state, job.run_attempt,
       next.attempt - next.run_offset AS next_attempt, next.own,
       NOT next.own AND next.attempt - next.run_offset > $6 AS over_cap, prior.held,
       prior.stream_entry, prior.consumer, prior.error_code, prior.last_error,
       coalesce((SELECT id FROM attempt_row), (SELECT id FROM own_row)) AS attempt_row
FROM p LEFT JOIN job ON true LEFT JOIN prior ON true LEFT JOIN next ON true
"""


@dataclass(frozen=True)
class Lease:
    """Who claims: the worker process (`holder`, unique per process), how long its lease
    runs between heartbeats, and this run's attempt cap (DARKROOM_MAX_ATTEMPTS)."""

    holder: str | None
    ms: int
    max_attempts: int

    @property
    def args(self) -> tuple[str | None, int, int]:
        """CLAIM_SQL's $4, $5, $6."""
        return self.holder, self.ms, self.max_attempts


# A claim from outside any worker process (a tool, a test): every one counts, none is
# held, no cap.
NO_LEASE = Lease(None, 0, 2**31 - 1)


@translated
async def claim(
    pool: Pool,
    photo_id: uuid.UUID,
    entry_id: str,
    consumer: str,
    lease: Lease = NO_LEASE,
    history_lane: str | None = None,
) -> Claim:
    """`history_lane`: write the delivery's `running` history row (with that lane) in the
    same statement when a job is claimed; None writes none."""
    row = await pool.fetchrow(CLAIM_SQL, photo_id, entry_id, consumer, *lease.args, history_lane)
    if row is None:
        return Claim("skipped", photo_id=photo_id)
    return _claim_of(photo_id, row)


def _claim_of(photo_id: uuid.UUID, row: Any) -> Claim:
    base = Claim("already", row["original_key"], state=row["processing_state"],
                 last_entry=row["stream_entry"], error_code=row["error_code"],
                 last_error=row["last_error"], photo_id=photo_id,
                 history_row=row["attempt_row"])  # fmt: skip
    if row["finished"]:
        return base
    if row["over_cap"]:  # the job is taken all the same: only its owner records a failure
        return replace(base, outcome="exhausted", attempt=row["next_attempt"])
    if row["run_attempt"] is not None:
        return replace(base, outcome="claimed", attempt=row["run_attempt"], counted=not row["own"])
    # a live owner, or (rarely) a claim that committed while this one waited for the photo
    return replace(base, outcome="busy", owner=row["consumer"] if row["held"] else None)


# A first render moves `processing` → `processed` and publishes. A re-render (a processed
# photo with a request) replaces renditions and facts in place: the photo stays processed,
# keeps its visibility and `processed_at`, and gets `rerendered_at`. `old` locks the row
# first, so `replaced` is exactly the renditions value this commit switched away from
# (the caller deletes the keys it no longer references, after the commit).
PUBLISH_SQL = """
WITH old AS (
    SELECT id, renditions, processing_state AS was FROM photos WHERE id = $1 FOR UPDATE
), photo AS (
    UPDATE photos SET processing_state = 'processed',
        visibility = CASE WHEN processing_state = 'processed' THEN visibility
                          ELSE 'published' END,
        width = $2, height = $3, format = $4, bytes = $5, renditions = $6::jsonb,
        taken_at_local = $7, taken_at = $8, camera_make = $9, camera_model = $10,
        lens_model = $11, exposure = $12::jsonb, original_sha256 = $13, has_alpha = $14,
        frames = $15, source_profile = $16, latitude = $17, longitude = $18,
        thumbhash = $19, dominant_color = $20,
        hdr = $21,
        rerendered_at = CASE WHEN processing_state = 'processed' THEN now()
                             ELSE rerendered_at END,
        rerender_requested_at = NULL,
        error_code = NULL, processed_at = coalesce(processed_at, now()), updated_at = now(),
        last_activity_at = now()
    FROM old
    WHERE photos.id = old.id
      AND (processing_state = 'processing'
           OR (processing_state = 'processed' AND rerender_requested_at IS NOT NULL))
    RETURNING photos.id, old.renditions AS replaced, old.was,
              photos AS changed
), job AS (
    UPDATE photo_jobs SET state = 'done', error_code = NULL, last_error = NULL,
        next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
    WHERE photo_id IN (SELECT id FROM photo) AND type = 'process'
), event AS (
    INSERT INTO photo_events (photo_id, type, data)
    SELECT id, CASE WHEN was = 'processed' THEN 'darkroom.photo.rerendered'
                    ELSE 'darkroom.photo.published' END,
           darkroom_event_data(changed, NULL, NULL)
    FROM photo
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
), attempt AS (
    -- the delivery's history row ($22; NULL: none), finished as `published` in this same
    -- commit: one statement less per photo than a separate UPDATE after it. Its publish_ms
    -- is this statement's own time in PostgreSQL so far (the worker cannot know the
    -- round trip before it ends).
    UPDATE photo_attempts SET ended_at = now(), outcome = 'published',
        download_ms = $23, render_ms = $24, upload_ms = $25, peak_rss_mb = $26,
        publish_ms = extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000
    WHERE id = $22 AND EXISTS (SELECT 1 FROM photo)
)
SELECT count(*) AS published, min(replaced::text) AS replaced FROM photo
"""


@dataclass(frozen=True)
class AttemptRow:
    """A delivery's `running` history row, for the publishing commit to finish (PUBLISH_SQL's
    `attempt`): its id (None: no row) and the stage times and peak RSS measured so far."""

    row_id: int | None = None
    download_ms: float | None = None
    render_ms: float | None = None
    upload_ms: float | None = None
    peak_rss_mb: float | None = None


@translated
async def publish(
    pool: Pool,
    photo_id: uuid.UUID,
    facts: dict[str, Any],
    renditions_json: str,
    attempt: AttemptRow = AttemptRow(),
) -> list[str] | None:
    """Publish in one transaction, only from `processing` (or a requested re-render): the
    keys of the renditions it replaced (none on a first render), or None if another
    delivery got there first (published it, or recorded its final failure). A published
    photo's `attempt` row is finished in the same commit."""
    row = await pool.fetchrow(
        PUBLISH_SQL,
        photo_id,
        *(facts[k] for k in ("width", "height", "format", "bytes")),
        renditions_json,
        *(facts.get(k) for k in FACT_COLUMNS[:5]),
        json.dumps(facts["exposure"]) if facts.get("exposure") else None,
        *(facts.get(k) for k in FACT_COLUMNS[6:]),
        attempt.row_id,
        attempt.download_ms,
        attempt.render_ms,
        attempt.upload_ms,
        attempt.peak_rss_mb,
    )
    if row is None or not row["published"]:
        return None
    return keys.keys_of(row["replaced"])


# the facts columns, in PUBLISH_SQL's parameter order ($7 onwards)
FACT_COLUMNS = (
    "taken_at_local", "taken_at", "camera_make", "camera_model", "lens_model", "exposure",
    "original_sha256", "has_alpha", "frames", "source_profile", "latitude", "longitude",
    "thumbhash", "dominant_color", "hdr",
)  # fmt: skip


REQUEST_RERENDER_SQL = """
UPDATE photos SET rerender_requested_at = now(), updated_at = now()
WHERE processing_state = 'processed'
  AND (id = ANY($1::uuid[]) OR ($2::timestamptz IS NOT NULL AND processed_at >= $2))
RETURNING id
"""


@translated
async def request_rerender(
    pool: Pool, photo_ids: list[uuid.UUID], since: datetime | None
) -> list[uuid.UUID]:
    """Mark processed photos (these, or all processed since a time) for a re-render; the
    ids that were marked. Photos in any other state are left alone."""
    rows = await pool.fetch(REQUEST_RERENDER_SQL, photo_ids, since)
    return sorted(row["id"] for row in rows)


# Only the entry that owns the job, in the process holding it, records its retry: a stale
# delivery (whose photo was re-enqueued through another entry since, or whose job another
# process took over) changes nothing. The attempt its claim counted stands.
RETRY_SQL = """
WITH job AS (
UPDATE photo_jobs SET state = 'pending', error_code = $2, last_error = $3,
    next_retry_at = now() + $4 * interval '1 millisecond', transient_since = NULL,
    updated_at = now()
WHERE photo_id = $1 AND type = 'process' AND state = 'active' AND stream_entry = $5
  AND holder IS NOT DISTINCT FROM $6
RETURNING photo_id
)
-- The photo's last activity moves with its job (the sweeper's keyset column). Every other
-- statement locks the photo before the job: SKIP LOCKED keeps this job-first one from
-- deadlocking with them, and whoever holds the photo sets last_activity_at itself.
, photo AS (
UPDATE photos SET last_activity_at = now()
WHERE id IN (SELECT id FROM photos WHERE id IN (SELECT photo_id FROM job) FOR UPDATE SKIP LOCKED)
)
SELECT count(*) FROM job
"""


@translated
async def record_retry(
    pool: Pool,
    photo_id: uuid.UUID,
    entry_id: str,
    code: str,
    message: str,
    delay_ms: int,
    lease: Lease = NO_LEASE,
) -> bool:
    """False when `entry_id` (in this process) no longer owns the photo's job (nothing is
    changed then)."""
    changed = await pool.fetchval(
        RETRY_SQL, photo_id, code, message[:2000], delay_ms, entry_id, lease.holder
    )
    return bool(changed)


# A final failure only by the delivery that owns the job: its entry, under this consumer,
# `active` (claimed). A worker that lost the entry to another consumer (XAUTOCLAIM after
# a lost heartbeat) cannot fail the photo the new owner is publishing; a stale duplicate
# of a photo re-enqueued through a newer entry cannot fail it either. One statement: the
# photo is locked first, as by every other statement that changes both.
FAIL_SQL = """
WITH p AS (
    SELECT id, processing_state IN ('uploaded', 'processing') AS open
    FROM photos WHERE id = $1 FOR UPDATE
), j AS (
    -- locked after the photo, so this is the job as it is now: a claim that took it over
    -- meanwhile (under the photo's lock) has committed
    SELECT jobs.stream_entry,
           jobs.stream_entry = $4 AND jobs.consumer = $5 AND jobs.state = 'active' AS owned
    FROM photo_jobs jobs JOIN p ON jobs.photo_id = p.id
    WHERE jobs.type = 'process'
    FOR UPDATE OF jobs
), job AS (
    UPDATE photo_jobs SET state = 'failed', error_code = $2, last_error = $3,
        next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
    FROM p, j WHERE photo_jobs.photo_id = p.id AND photo_jobs.type = 'process'
      AND p.open AND j.owned
    RETURNING photo_jobs.photo_id
), photo AS (
    UPDATE photos SET processing_state = 'processing_failed', error_code = $2,
        updated_at = now(), last_activity_at = now()
    WHERE id IN (SELECT photo_id FROM job)
    RETURNING photos AS changed
), event AS (
    INSERT INTO photo_events (photo_id, type, data)
    SELECT (changed).id, 'darkroom.photo.failed', darkroom_event_data(changed, $2, $3)
    FROM photo
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
)
SELECT CASE
    WHEN EXISTS (SELECT 1 FROM job) THEN 'failed'
    WHEN NOT EXISTS (SELECT 1 FROM p WHERE open) THEN 'finished'
    WHEN EXISTS (SELECT 1 FROM j WHERE stream_entry <> $4) THEN 'finished'
    ELSE 'not_owner' END
"""

FailRecord = Literal["failed", "finished", "not_owner"]


@translated
async def record_failure(
    pool: Pool, photo_id: uuid.UUID, entry_id: str, consumer: str, code: str, message: str
) -> FailRecord:
    """Final failure, atomically on job and photo, by the delivery that owns the job:
    `failed`. Nothing changes otherwise: `finished` when the photo is already terminal
    (processed, or failed through another delivery), gone, or owned by another entry (this
    entry is a stale duplicate); `not_owner` when this consumer does not hold the job
    under this entry (another consumer reclaimed it, or this delivery never claimed it)."""
    record: FailRecord = await pool.fetchval(
        FAIL_SQL, photo_id, code, message[:2000], entry_id, consumer
    )
    return record


# A re-render (a processed photo with a request) that failed for good: its job records the
# code and message; the photo keeps its renditions, state and request (nothing else moves).
# Only by the delivery that owns the job, as FAIL_SQL.
RERENDER_FAILED_SQL = """
WITH p AS (
    -- the photo first, as every statement that writes an event (its order per photo)
    SELECT id, processing_state, rerender_requested_at, photos AS photo
    FROM photos WHERE id = $1 FOR UPDATE
), job AS (
UPDATE photo_jobs j SET state = 'failed', error_code = $2, last_error = $3,
    next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
FROM p
WHERE j.photo_id = $1 AND j.type = 'process' AND j.stream_entry = $4 AND j.state = 'active'
  AND j.consumer = $5
  AND p.id = $1 AND p.processing_state = 'processed' AND p.rerender_requested_at IS NOT NULL
RETURNING j.photo_id
), event AS (
    INSERT INTO photo_events (photo_id, type, data)
    SELECT p.id, 'darkroom.photo.rerender_failed', darkroom_event_data(p.photo, $2, $3)
    FROM p WHERE p.id IN (SELECT photo_id FROM job)
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
)
SELECT photo_id FROM job
"""


@translated
async def record_rerender_failure(
    pool: Pool, photo_id: uuid.UUID, entry_id: str, consumer: str, code: str, message: str
) -> bool:
    row = await pool.fetchval(
        RERENDER_FAILED_SQL, photo_id, code, message[:2000], entry_id, consumer
    )
    return row is not None


# The heartbeat of this process's claims: their leases move on, so a worker that reclaims
# one of their entries (a Redis outage ate the stream's heartbeat) finds the owner alive.
RENEW_SQL = """
UPDATE photo_jobs SET lease_until = now() + $3 * interval '1 millisecond'
WHERE photo_id = ANY($2::uuid[]) AND type = 'process' AND state = 'active' AND holder = $1
"""


@translated
async def renew_leases(pool: Pool, lease: Lease, photo_ids: list[uuid.UUID]) -> None:
    if photo_ids:
        await pool.execute(RENEW_SQL, lease.holder, photo_ids, lease.ms)


# The photo's streak of transient errors, on the job this process holds: started now unless
# one runs already (`$3`: an outage ended the last one); its age in seconds, by the
# database's clock. Kept across restarts and reclaims; publish, failure and retry clear it.
STREAK_SQL = """
UPDATE photo_jobs SET transient_since = CASE WHEN $3 OR transient_since IS NULL THEN now()
                                             ELSE transient_since END
WHERE photo_id = $1 AND type = 'process' AND state = 'active' AND holder = $2
RETURNING extract(epoch FROM now() - transient_since)::float8
"""


@translated
async def transient_streak_s(
    pool: Pool, photo_id: uuid.UUID, lease: Lease, restart: bool
) -> float | None:
    """None when this process no longer holds the job."""
    age_s: float | None = await pool.fetchval(STREAK_SQL, photo_id, lease.holder, restart)
    return age_s


# A stop cut this process's claim short (a wait in place, the grace period): not an
# attempt. Undone in the statement that gives the job back, so the next claim counts once.
RELEASE_SQL = """
UPDATE photo_jobs SET state = 'pending', attempt = greatest(run_offset, attempt - 1),
    lease_until = NULL, updated_at = now()
WHERE photo_id = $1 AND type = 'process' AND state = 'active' AND holder = $2
RETURNING attempt
"""


@translated
async def release(pool: Pool, photo_id: uuid.UUID, lease: Lease) -> bool:
    """False when this process no longer holds the job (nothing is changed then)."""
    return await pool.fetchval(RELEASE_SQL, photo_id, lease.holder) is not None


@translated
async def rerender_held_elsewhere(
    pool: Pool, photo_id: uuid.UUID, entry_id: str, consumer: str
) -> bool:
    """A re-render of this photo is under way through another delivery (its job active,
    not this entry under this consumer): a stale delivery must leave the entry to it."""
    held = await pool.fetchval(RERENDER_HELD_SQL, photo_id, entry_id, consumer)
    return bool(held)


RERENDER_HELD_SQL = """
SELECT EXISTS (
    SELECT 1 FROM photos p JOIN photo_jobs j ON j.photo_id = p.id
    WHERE p.id = $1 AND p.processing_state = 'processed'
      AND p.rerender_requested_at IS NOT NULL AND j.type = 'process'
      AND j.state = 'active' AND NOT (j.stream_entry = $2 AND j.consumer = $3))
"""


@translated
async def last_error(pool: Pool, photo_id: uuid.UUID) -> tuple[str | None, str | None]:
    row = await pool.fetchrow(
        "SELECT error_code, last_error FROM photo_jobs WHERE photo_id = $1 AND type = 'process'",
        photo_id,
    )
    return (row["error_code"], row["last_error"]) if row else (None, None)


# One pass over photos for both tables of the status: by state, and failures by code.
COUNTS_SQL = "SELECT processing_state, error_code, count(*)::int AS n FROM photos GROUP BY 1, 2"


@translated
async def photo_counts(pool: Pool) -> tuple[dict[str, int], dict[str, int]]:
    """(photos by state, failed photos by error code), from one query."""
    return fold_counts([tuple(row) for row in await pool.fetch(COUNTS_SQL)])


def fold_counts(
    rows: list[tuple[str, str | None, int]],
) -> tuple[dict[str, int], dict[str, int]]:
    """States in name order; failure codes most frequent first (a failure without a code
    shows as `unknown`)."""
    states: dict[str, int] = {}
    failures: dict[str, int] = {}
    for state, code, n in rows:
        states[state] = states.get(state, 0) + n
        if state == "processing_failed":
            failures[code or "unknown"] = failures.get(code or "unknown", 0) + n
    by_code = sorted(failures.items(), key=lambda item: (-item[1], item[0]))
    return dict(sorted(states.items())), dict(by_code)


@translated
async def list_photos(pool: Pool, state: str | None, limit: int) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        """
        SELECT p.id, p.processing_state, p.visibility, p.format, p.width, p.height, p.bytes,
               p.error_code, coalesce(j.attempt, 0) AS attempt,
               coalesce(jsonb_array_length(p.renditions), 0) AS renditions, p.updated_at,
               p.lane, p.tenant
        FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
        WHERE $1::text IS NULL OR p.processing_state = $1
        ORDER BY p.updated_at DESC, p.id LIMIT $2
        """,
        state,
        limit,
    )
    return [dict(row) for row in rows]


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
async def sweep_horizon(conn: Connection, after_s: float) -> datetime:
    """The database's now() minus `after_s`: a pass looks only at activity before it."""
    horizon: datetime = await conn.fetchval("SELECT now() - make_interval(secs => $1)", after_s)
    return horizon


@translated
async def stale_photos(
    conn: Connection, before: datetime, limit: int, after: Cursor = FIRST_PAGE
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


REQUEUED_SQL = """
WITH photo AS (
    UPDATE photos SET last_activity_at = now(), enqueued_at = now() WHERE id = $1 RETURNING id
)
INSERT INTO photo_jobs AS j (photo_id, type, state, stream_entry)
SELECT id, 'process', 'pending', $2 FROM photo
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


@translated
async def record_requeued(
    conn: Pool | Connection | asyncpg.Connection, photo_id: uuid.UUID, entry_id: str
) -> None:
    """Remember the entry a photo was last enqueued through (the sweeper checks it) and
    when (the feeder enqueues no photo whose `enqueued_at` is set)."""
    await conn.execute(REQUEUED_SQL, photo_id, entry_id)


@contextlib.asynccontextmanager
async def advisory_lock(pool: Pool, name: str) -> AsyncIterator[Connection | None]:
    """A connection holding a session try-lock (statements on it autocommit, one by one);
    yields None if another process holds it. A dead holder's lock goes with its connection."""
    with errors.map_exceptions(ERRORS):
        async with pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", name):
                yield None
                return
            try:
                yield conn
            finally:
                await _unlock(conn, name)


async def _unlock(conn: Connection, name: str) -> None:
    """Unlock, or close the connection (its session's locks go with it): a pooled
    connection is given back without a reset, so it must not keep the lock."""
    unlocked = False
    try:
        unlocked = await conn.fetchval("SELECT pg_advisory_unlock(hashtext($1))", name)
    finally:
        if not unlocked:
            conn.terminate()


RESET_SQL = """
WITH photo AS (
    UPDATE photos SET processing_state = 'uploaded', error_code = NULL, updated_at = now(),
        last_activity_at = now()
    WHERE id = $1 AND processing_state = 'processing_failed'
    RETURNING id
)
UPDATE photo_jobs SET state = 'pending', finished_at = NULL, next_retry_at = NULL,
    run_offset = attempt, transient_since = NULL, updated_at = now()
WHERE photo_id IN (SELECT id FROM photo) AND type = 'process'
RETURNING photo_id
"""


@translated
async def reset_failed(pool: Pool, photo_id: uuid.UUID) -> bool:
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


@contextlib.asynccontextmanager
async def hold_photo(pool: Pool, photo_id: uuid.UUID) -> AsyncIterator[keys.Held | None]:
    """The photo read under its row lock, held until the block ends (None: no such row).
    A claim or a publish of this photo waits for the block, so what is deleted inside it
    cannot be claimed, re-uploaded and committed in between."""
    with errors.map_exceptions(ERRORS):
        async with pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(HELD_SQL + " FOR UPDATE OF p", [photo_id])
            yield _held(row) if row is not None else None


# -- the operator's web page (issue 9) -------------------------------------------------------

PHOTO_DETAIL_SQL = """
SELECT p.id, p.original_key, p.processing_state, p.visibility, p.error_code, p.width,
       p.height, p.format, p.bytes, p.renditions::text AS renditions, p.created_at,
       p.updated_at, p.processed_at,
       j.state AS job_state, coalesce(j.attempt, 0) AS attempt, j.error_code AS job_error_code,
       j.last_error, j.next_retry_at, j.stream_entry, j.consumer, j.started_at, j.finished_at,
       j.updated_at AS job_updated_at
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE p.id = $1
"""


@translated
async def photo_detail(pool: Pool, photo_id: uuid.UUID) -> dict[str, Any] | None:
    """One photo with its job row; `renditions` is the JSON text as stored."""
    row = await pool.fetchrow(PHOTO_DETAIL_SQL, photo_id)
    return dict(row) if row else None


# Newest first, one keyset page strictly before ($2, $3) on (updated_at, id), LIMIT $1.
# One statement per filter shape, the state a literal: photos_updated_idx serves no filter
# (or a common state), photos_state_updated_idx a rare state, photos_code_idx a code. A
# page reads about LIMIT index entries. Only failed photos have a code (every statement
# that moves a photo out of processing_failed clears it), so a code filter needs no state
# condition, which would also make the planner count failed photos twice (code × state)
# and prefer reading every photo of the code and sorting them.
PAGE_PHOTOS_SQL = """
SELECT p.id, p.processing_state, p.format, p.width, p.height, p.bytes, p.error_code,
       p.renditions::text AS renditions, coalesce(j.attempt, 0) AS attempt, p.updated_at
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE (p.updated_at, p.id) < ($2, $3){filters}
ORDER BY p.updated_at DESC, p.id DESC
LIMIT $1
"""
STATES = ("uploaded", "processing", "processed", "processing_failed")
# Before every photo: the cursor of a first page.
NEWEST: Cursor = (datetime.max.replace(tzinfo=UTC), uuid.UUID(int=(1 << 128) - 1))


def page_photos_sql(state: str | None, code: bool) -> str:
    """The page statement for this filter shape ($4: the code). A code filters failed
    photos, so it takes no other state."""
    if code and state not in (None, "processing_failed"):
        raise ValueError("an error code filters failed photos: state must be processing_failed")
    if state is not None and state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}")
    if code:
        return PAGE_PHOTOS_SQL.format(filters=" AND p.error_code = $4")
    return PAGE_PHOTOS_SQL.format(filters=f" AND p.processing_state = '{state}'" if state else "")


@translated
async def page_photos(
    pool: Pool,
    state: str | None,
    code: str | None,
    limit: int,
    before: Cursor | None = None,
) -> list[dict[str, Any]]:
    sql = page_photos_sql(state, code is not None)
    async with pool.acquire() as conn, conn.transaction(readonly=True):
        # A plan for these very values: a generic plan (which the plan cache may settle on
        # after five runs) cannot see the cursor, and may filter photos_updated_idx for a
        # rare state, reading every photo. LOCAL: it ends with this transaction (a pooled
        # connection is given back without a reset).
        await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
        rows = await conn.fetch(sql, limit, *(before or NEWEST), *([code] if code else []))
    return [dict(row) for row in rows]


# Photos finished per `$1` bucket ('minute' or 'hour') over the last $2 seconds: processed
# from processed_at, failed from the updated_at of failed photos. Buckets with none are absent.
THROUGHPUT_SQL = """
SELECT date_trunc($1, t, 'UTC') AS bucket,
       sum(processed)::int AS processed, sum(failed)::int AS failed
FROM (
    SELECT processed_at AS t, 1 AS processed, 0 AS failed FROM photos
    WHERE processed_at >= now() - make_interval(secs => $2)
    UNION ALL
    SELECT updated_at, 0, 1 FROM photos
    WHERE processing_state = 'processing_failed' AND updated_at >= now() - make_interval(secs => $2)
) finished
GROUP BY 1 ORDER BY 1
"""


Series = list[tuple[Any, int, int]]


@translated
async def throughput(
    pool: Pool, bucket: Literal["minute", "hour"], span_s: float
) -> tuple[Any, Series]:
    """(now, [(bucket start, processed, failed), ...]) in the database's clock."""
    async with pool.acquire() as conn, conn.transaction():
        now = await conn.fetchval("SELECT now()")
        rows = await conn.fetch(THROUGHPUT_SQL, bucket, span_s)
    return now, [(r["bucket"], r["processed"], r["failed"]) for r in rows]
