"""PostgreSQL of the per-tenant rate limits (`tenant_limits`): the truth the feeder reloads
and status shows; every set and clear writes its audit row in the same transaction, so
the trail and the table never disagree.
"""

from __future__ import annotations

from datetime import datetime
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


# The interactive uploads of these tenants ($1) committed in ($2, $3]: $3 is PostgreSQL's
# clock less a grace, so a row inserted just before it (created_at is its transaction's
# start) has committed by then; one that commits later still is never charged (an
# undercharge, never a delay). Served by photos_interactive_tenant_idx.
INTERACTIVE_SQL = """
SELECT tenant, count(*) AS n FROM photos
WHERE lane = 'interactive' AND tenant = ANY($1::text[]) AND tenant <> ''
  AND created_at > $2 AND created_at <= $3
GROUP BY tenant
"""
BOUND_SQL = "SELECT now() - make_interval(secs => $1)"


@translated
async def interactive_uploads(
    conn: asyncpg.Connection, tenants: list[str], after: datetime | None, grace_s: float
) -> tuple[dict[str, int], datetime]:
    """The tenants' interactive uploads since `after` (None: none yet, the window starts
    now), and the bound to pass as `after` next time."""
    bound: datetime = await conn.fetchval(BOUND_SQL, grace_s)
    if after is None or not tenants:
        return {}, bound
    rows = await conn.fetch(INTERACTIVE_SQL, tenants, after, bound)
    return {row["tenant"]: row["n"] for row in rows}, bound


@translated
async def listed(conn: Pool | Connection | asyncpg.Connection) -> list[dict[str, Any]]:
    """Every tenant's own limit, by tenant."""
    return [dict(row) for row in await conn.fetch(LIST_SQL)]


def limits_of(rows: list[dict[str, Any]]) -> dict[str, Limit]:
    """The rows of `listed` as limits, by tenant."""
    names = ("tenant", "per_s", "burst", "interactive", "shown")
    return {row["tenant"]: Limit(**{n: row[n] for n in names}) for row in rows}
