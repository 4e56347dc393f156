"""The database's probe, at start-up and in an outage: a writable primary, each grant the
worker uses checked one by one (`has_table_privilege('t', 'SELECT,INSERT')` is true when
*any* one is held), and every statement of darkroom parsed against the live schema, so a
role without a grant or a schema older or newer than the code is named before a photo
meets it, and an outage for it lasts until it is fixed.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import asyncpg

from darkroom import errors, store
from darkroom.errors import DarkroomError, DatabaseUnavailableError
from darkroom.store.db import ERRORS, Connection, Pool, translated

READ_ONLY_SQL = """
SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'
"""

# What the worker reads and writes: the claim, the publish and the failure records write
# photos and photo_jobs, every delivery a photo_attempts row, every outcome a photo_events
# row; the retention deletes from both; each insert draws an id from its table's sequence.
# `photos` INSERT is the producer's (`ingest`), not the worker's.
GRANTS: tuple[tuple[str, str], ...] = (
    ("photos", "SELECT"), ("photos", "UPDATE"),
    ("photo_jobs", "SELECT"), ("photo_jobs", "INSERT"), ("photo_jobs", "UPDATE"),
    ("photo_attempts", "SELECT"), ("photo_attempts", "INSERT"), ("photo_attempts", "UPDATE"),
    ("photo_attempts", "DELETE"),
    ("photo_events", "SELECT"), ("photo_events", "INSERT"), ("photo_events", "UPDATE"),
    ("photo_events", "DELETE"),
    ("darkroom_duties", "SELECT"), ("darkroom_duties", "INSERT"), ("darkroom_duties", "UPDATE"),
    ("queue_pauses", "SELECT"),
    ("photo_jobs.id", "USAGE"), ("photo_attempts.id", "USAGE"), ("photo_events.id", "USAGE"),
)  # fmt: skip

# One row per grant missing; a `table.column` names that column's sequence. A table that
# does not exist raises 42P01 (schema_missing).
MISSING_SQL = """
SELECT g.object, g.privilege
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS g(object, privilege, n)
WHERE NOT CASE WHEN g.object LIKE '%.%'
    THEN coalesce(has_sequence_privilege(pg_get_serial_sequence(
        split_part(g.object, '.', 1), split_part(g.object, '.', 2)), g.privilege), true)
    ELSE has_table_privilege(g.object, g.privilege) END
ORDER BY g.n
"""


@translated
async def ping(pool: Pool) -> None:
    """The database answers a query (the web process's readiness: it reads, and writes
    only on an operator's action, which then names its own failure)."""
    await pool.fetchval("SELECT 1")


@translated
async def check(pool: Pool) -> None:
    """Raise the first thing the worker needs and lacks: `read_only`, `permission_denied`
    (naming each missing grant), `schema_missing` or `schema_mismatch` (naming the
    statement and what it lacks). Nothing is written or run but the checks."""
    async with pool.acquire() as conn:
        if await conn.fetchval(READ_ONLY_SQL):
            raise DatabaseUnavailableError("server is read-only (a replica)", reason="read_only")
        missing = await conn.fetch(MISSING_SQL, *zip(*GRANTS, strict=True))
        if missing:
            named = ", ".join(f"{r['privilege']} on {_object(r['object'])}" for r in missing)
            raise DatabaseUnavailableError(
                f"permission_denied: the role lacks {named}", reason="permission_denied"
            )
        for name, sql in statements():
            await _parses(conn, name, sql)


async def _parses(conn: Connection, name: str, sql: str) -> None:
    """PREPARE resolves every table, column, function and type of `sql` and runs nothing
    (privileges are checked only when a statement runs: GRANTS covers them)."""
    try:
        await conn.prepare(sql)
    except asyncpg.PostgresError as exc:
        found = errors.classify(ERRORS, exc)
        assert found is not None  # ERRORS ends with a row for every PostgresError
        raise _named(found, name) from exc


def statements() -> Iterator[tuple[str, str]]:
    """Every `*_SQL` statement of the store package, by its module and name (a template
    with `{}` left to fill is built per call and skipped)."""
    for module in pkgutil.iter_modules(store.__path__, f"{store.__name__}."):
        found = vars(importlib.import_module(module.name))
        for name, sql in sorted(found.items()):
            if name.endswith("_SQL") and isinstance(sql, str) and "{" not in sql:
                yield f"{module.name.rsplit('.', 1)[1]}.{name}", sql


def _named(found: DarkroomError, statement: str) -> DarkroomError:
    said = str(found).removeprefix(f"{found.reason}: ")
    return type(found)(
        f"{found.reason}: {statement}: {said}", reason=found.reason, transient=found.transient
    )


def _object(name: str) -> str:
    table, _, column = name.partition(".")
    return f"the sequence of {table}.{column}" if column else name
