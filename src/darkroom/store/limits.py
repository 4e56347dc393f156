"""PostgreSQL of the per-tenant rate limits (`tenant_limits`): the truth the feeder reloads
and status shows; every set and clear writes its audit row in the same transaction, so
the trail and the table never disagree.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import msgspec

from darkroom.store import audit
from darkroom.store.db import Connection, Pool, translated


class Limit(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's bulk rate (`per_s` photos a second, 0: unlimited), how many photos may
    start at once after an idle spell (`burst`), and whether its interactive photos are
    charged too; `shown` is the rate as the operator wrote it (`20/s`)."""

    tenant: str
    per_s: float
    burst: int
    interactive: bool = False
    shown: str = ""


SET_SQL = """
INSERT INTO tenant_limits (tenant, per_s, burst, interactive, shown)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (tenant) DO UPDATE SET per_s = excluded.per_s, burst = excluded.burst,
    interactive = excluded.interactive, shown = excluded.shown, updated_at = now()
"""
CLEAR_SQL = "DELETE FROM tenant_limits WHERE tenant = $1 RETURNING tenant"
# Operators set a handful of limits, not one per tenant: the whole table is one page.
LIST_SQL = """
SELECT tenant, per_s, burst, interactive, shown, updated_at FROM tenant_limits ORDER BY tenant
"""


@translated
async def set_limit(pool: Pool, limit: Limit, action: audit.Action) -> None:
    """Record `limit` (replacing the tenant's own) and its audit row, in one transaction."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(SET_SQL, limit.tenant, limit.per_s, limit.burst, limit.interactive,
                           limit.shown)  # fmt: skip
        await audit.record(conn, action, "done", None, msgspec.to_builtins(limit))


@translated
async def clear_limit(pool: Pool, tenant: str, action: audit.Action) -> bool:
    """Drop the tenant's own limit (DARKROOM_TENANT_RATE applies again); False if it had
    none, and the audit row says `refused`, count 0."""
    async with pool.acquire() as conn, conn.transaction():
        cleared = await conn.fetchval(CLEAR_SQL, tenant) is not None
        await audit.record(conn, action, "done" if cleared else "refused", int(cleared))
    return cleared


@translated
async def listed(conn: Pool | Connection | asyncpg.Connection) -> list[dict[str, Any]]:
    """Every tenant's own limit, by tenant."""
    return [dict(row) for row in await conn.fetch(LIST_SQL)]


def limits_of(rows: list[dict[str, Any]]) -> dict[str, Limit]:
    """The rows of `listed` as limits, by tenant."""
    names = ("tenant", "per_s", "burst", "interactive", "shown")
    return {row["tenant"]: Limit(**{n: row[n] for n in names}) for row in rows}
