"""What the operator reads of PostgreSQL: `status`'s counts, `darkroom photos`, and the web
page's photo detail, keyset pages and throughput chart. Read-only statements, each served by
an index (schema.sql) so that a page costs O(page) whatever the tables hold.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, Literal

from darkroom.store.db import Cursor, Pool, translated

# The status's counts (`darkroom status`, the page's overview and its /metrics, every few
# seconds) cost the same whatever photos holds. A finished state (processed, erased: the
# states that grow for good) that ANALYZE's sample puts past SKIP_AT is not counted at all:
# its figure is the planner's estimate. Every other state, and the failures by code, are
# counted on their own index (photos_state_updated_idx, photos_code_idx) up to COUNTS_CAP
# rows. So what an operator acts on (queued, in progress, failed, by code) stays exact while
# it is under the cap, however stale the statistics (autovacuum re-analyzes only after a
# tenth of the table changed: a drained backlog's estimate would stand for hours), and no
# count reads the processed photos' index entries.
COUNTS_CAP = 10_000
STATES = ("uploaded", "processing", "processed", "processing_failed", "erased")
SKIPPABLE = ("processed", "erased")
# Each common value's share of the last ANALYZE's sample times the table's row estimate,
# for the columns named (no row before the first ANALYZE). Looked up by the view's own
# columns, so the catalog is read through its indexes, not scanned.
SHARES_SQL = """
SELECT s.attname::text AS attname, v.value, v.freq * greatest(c.reltuples, 0) AS n
FROM pg_class c
JOIN pg_namespace ns ON ns.oid = c.relnamespace
JOIN pg_stats s ON s.schemaname = ns.nspname AND s.tablename = c.relname AND NOT s.inherited
CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs)
    AS v(value, freq)
WHERE c.oid = 'photos'::regclass AND s.attname IN ({columns})
"""
# The finished states' shares, which decide whether to count them (every state is counted
# before the first ANALYZE).
SHARES_CTE = (
    "WITH share AS (SELECT value AS state, n FROM ("
    + SHARES_SQL.format(columns="'processing_state'")
    + ") shares)\n"
)


def _count(state: str) -> str:
    capped = (f"(SELECT count(*) FROM (SELECT 1 FROM photos WHERE processing_state = '{state}'"
              " LIMIT {limit}) capped)")  # fmt: skip
    if state not in SKIPPABLE:
        return capped
    return (
        f"CASE WHEN coalesce((SELECT n FROM share WHERE state = '{state}'), 0) < {{skip_at}}"
        f" THEN {capped} END"
    )


# Each state a literal of its own, so each is planned with its own statistics: a rare
# state reads its index, not the whole table (one correlated subquery over the states
# array was planned once for all of them: a sequential scan of 1,000,000 rows to find 0).
# A finished state's CASE counts it only when its estimate is under {skip_at}. The bounds
# are literals, not parameters: with a parameter in LIMIT the plan cache kept planning it
# anew (2 ms a call, most of its cost), while a statement without one is planned once.
COUNTS_SQL = SHARES_CTE + "\nUNION ALL\n".join(
    [
        f"SELECT '{state}' AS state, NULL::text AS code, {_count(state)}::int AS n,"
        f" (SELECT n FROM share WHERE state = '{state}') AS estimate"
        for state in STATES
    ]
    + [
        "SELECT 'rows', NULL, NULL, greatest(reltuples, 0)::float8 FROM pg_class"
        " WHERE oid = 'photos'::regclass",
        "(SELECT 'processing_failed', error_code, count(*)::int, NULL FROM (SELECT error_code"
        " FROM photos WHERE error_code IS NOT NULL LIMIT {limit}) coded GROUP BY 2)",
    ]
)
# Past the cap for the failures too: each code's share of ANALYZE's sample (a code too
# rare for the sample is left out of an estimated table).
ESTIMATED_COUNTS_SQL = """
SELECT 'rows' AS attname, NULL AS value, greatest(c.reltuples, 0)::float8 AS n
FROM pg_class c WHERE c.oid = 'photos'::regclass
UNION ALL""" + SHARES_SQL.format(columns="'processing_state', 'error_code'")

Counts = tuple[dict[str, int], dict[str, int]]


@translated
async def photo_counts(pool: Pool) -> Counts:
    """(photos by state, failed photos by error code): exact under COUNTS_CAP each."""
    by_state, failures, _ = await counts(pool)
    return by_state, failures


@translated
async def counts(pool: Pool) -> tuple[dict[str, int], dict[str, int], bool]:
    """(photos by state, failed photos by error code, estimated): True when a count past
    COUNTS_CAP, or a finished state the statistics put past twice it, is the planner's
    estimate."""
    rows = await pool.fetch(COUNTS_SQL.format(limit=COUNTS_CAP + 1, skip_at=2 * COUNTS_CAP))
    states, codes, estimates = read_counts([tuple(r) for r in rows], COUNTS_CAP)
    if max(states.values(), default=0) <= COUNTS_CAP and sum(codes.values()) <= COUNTS_CAP:
        return (*fold_exact(states, codes), False)
    if sum(codes.values()) > COUNTS_CAP:  # the codes' shares of ANALYZE's sample too
        estimates = [tuple(r) for r in await pool.fetch(ESTIMATED_COUNTS_SQL)]
    if not any(name == "rows" and n > 0 for name, _, n in estimates):
        # Never analyzed yet (autovacuum's first ANALYZE comes soon): a full count, once.
        return (*fold_counts([tuple(r) for r in await pool.fetch(ALL_COUNTS_SQL)]), False)
    return (*fold_estimates(states, codes, estimates, COUNTS_CAP), True)


Estimates = list[tuple[str, Any, float]]


def read_counts(
    rows: list[tuple[str, str | None, int | None, float | None]], cap: int
) -> tuple[dict[str, int], dict[str, int], Estimates]:
    """Pure: COUNTS_SQL's rows as (states, codes, estimates); a state left uncounted for
    its estimate stands at cap + 1, past the cap."""
    states = {state: cap + 1 if n is None else n for state, code, n, _ in rows
              if code is None and state != "rows"}  # fmt: skip
    codes = {code: n or 0 for _, code, n, _ in rows if code is not None}
    estimates: Estimates = [
        ("rows", None, estimate or 0.0) if state == "rows"
        else ("processing_state", state, estimate or 0.0)
        for state, code, _, estimate in rows if code is None
    ]  # fmt: skip
    return {state: n for state, n in states.items() if n}, codes, estimates


ALL_COUNTS_SQL = "SELECT processing_state, error_code, count(*)::int AS n FROM photos GROUP BY 1, 2"


def fold_exact(states: dict[str, int], codes: dict[str, int]) -> Counts:
    """Pure: exact counts as the status shows them (a failure without a code: `unknown`)."""
    rows: list[tuple[str, str | None, int]]
    rows = [(state, None, n) for state, n in states.items() if state != "processing_failed"]
    rows += [("processing_failed", code, n) for code, n in codes.items()]
    unknown = states.get("processing_failed", 0) - sum(codes.values())
    return fold_counts([*rows, *([("processing_failed", None, unknown)] if unknown > 0 else [])])


def fold_estimates(
    states: dict[str, int], codes: dict[str, int], estimates: list[tuple[str, str, float]], cap: int
) -> Counts:
    """Pure: the counts past `cap` replaced by estimates. One state past it (the usual
    case: processed photos) is the table's row estimate less the exact others; several
    take their share of ANALYZE's sample. Failure codes past it come from the sample too."""
    rows = next((n for name, _, n in estimates if name == "rows"), 0.0)
    share = {v: n for name, v, n in estimates if name == "processing_state"}
    over = [state for state, n in states.items() if n > cap]
    exact = sum(n for state, n in states.items() if state not in over)
    for state in over:
        guess = rows - exact if len(over) == 1 else share.get(state, 0.0)
        states[state] = max(cap + 1, round(guess))
    if sum(codes.values()) > cap:
        by_state, _ = fold_exact(states, {})
        coded = {v: round(n) for name, v, n in estimates if name == "error_code" and v}
        # the sample's NULL codes are not among its common values: the rest is `unknown`
        unknown = by_state.get("processing_failed", 0) - sum(coded.values())
        coded |= {"unknown": unknown} if unknown > 0 else {}
        return by_state, dict(sorted(coded.items(), key=lambda item: (-item[1], item[0])))
    return fold_exact(states, codes)


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


# What live job leases hold now, by lane and tenant: the work being rendered this moment,
# counted from the leases themselves (photo_jobs_unfinished_idx: O(unfinished work)).
LEASED_SQL = """
SELECT p.lane, p.tenant, count(*)::int AS n
FROM photo_jobs j JOIN photos p ON p.id = j.photo_id
WHERE j.state IN ('pending', 'active') AND j.state = 'active' AND j.lease_until > now()
GROUP BY 1, 2 ORDER BY 1, 2
"""


@translated
async def leased(pool: Pool) -> list[dict[str, Any]]:
    """[{lane, tenant, n}]: photos a live lease holds, by lane and tenant."""
    return [dict(r) for r in await pool.fetch(LEASED_SQL)]


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


PHOTO_DETAIL_SQL = """
SELECT p.id, p.original_key, p.processing_state, p.visibility, p.error_code, p.width,
       p.height, p.format, p.bytes, p.renditions::text AS renditions, p.created_at,
       p.updated_at, p.processed_at, p.traceparent,
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
STATES = ("uploaded", "processing", "processed", "processing_failed", "erased")
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


# Photos finished per `$1` bucket ('minute' or 'hour') over the last $2 seconds, from $3 on
# if given (NULL: the whole span): processed from processed_at, failed from the updated_at
# of failed photos. Buckets with none are absent.
# One statement, one round trip: the database's clock (`now`) on every row, and one row
# with a NULL bucket when nothing finished.
THROUGHPUT_SQL = """
SELECT now() AS now, b.bucket, b.processed, b.failed
FROM (SELECT 1) one LEFT JOIN (
    SELECT date_trunc($1, t, 'UTC') AS bucket,
           sum(processed)::int AS processed, sum(failed)::int AS failed
    FROM (
        SELECT processed_at AS t, 1 AS processed, 0 AS failed FROM photos
        WHERE processed_at >= greatest(now() - make_interval(secs => $2), $3::timestamptz)
        UNION ALL
        SELECT updated_at, 0, 1 FROM photos
        WHERE processing_state = 'processing_failed'
          AND updated_at >= greatest(now() - make_interval(secs => $2), $3::timestamptz)
    ) finished
    GROUP BY 1
) b ON true
ORDER BY b.bucket
"""


Series = list[tuple[Any, int, int]]


@translated
async def throughput(
    pool: Pool, bucket: Literal["minute", "hour"], span_s: float, since: datetime | None = None
) -> tuple[Any, Series]:
    """(now, [(bucket start, processed, failed), ...]) in the database's clock; only the
    photos finished from `since` on, if given."""
    rows = await pool.fetch(THROUGHPUT_SQL, bucket, span_s, since)
    return rows[0]["now"], [
        (r["bucket"], r["processed"], r["failed"]) for r in rows if r["bucket"] is not None
    ]
