"""Pauses in PostgreSQL (queue_pauses): the truth every replica reads, so a pause outlives
any worker and Redis. A pause and a resume each commit with their event (photo_events, the
outbox) and their audit row (operator_actions) in one transaction. A pause past its
`until` is no pause: every reader compares it with now(), so it holds nothing from then on;
its row is ended once by whoever comes first (`expire`), with its `resumed` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from darkroom.store import audit
from darkroom.store.db import Connection, Pool, translated

# What a queue event is about is no photo: its subject is the nil UUID.
NO_PHOTO = uuid.UUID(int=0)
PAUSED, RESUMED = "darkroom.queue.paused", "darkroom.queue.resumed"
COLUMNS = "lane, tenant, operator, reason, since, until"
LIVE = "(until IS NULL OR until > now())"
ACTIVE_SQL = f"""
SELECT {COLUMNS} FROM queue_pauses WHERE {LIVE} ORDER BY lane NULLS FIRST, tenant NULLS FIRST
"""
# One scope holds one pause: pausing it again replaces who, why and until when.
PAUSE_SQL = f"""
INSERT INTO queue_pauses (lane, tenant, operator, reason, until)
VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))
ON CONFLICT (coalesce(lane, ''), coalesce(tenant, ''), (tenant IS NULL)) DO UPDATE SET
    operator = EXCLUDED.operator, reason = EXCLUDED.reason, since = now(),
    until = EXCLUDED.until
RETURNING {COLUMNS}
"""
# Resuming a scope ends every pause inside it: no lane resumes them in every lane, no
# tenant resumes each tenant's too. Its transaction expires the timed ones first, with the
# same now(): every row this finds is in force.
RESUME_SQL = f"""
DELETE FROM queue_pauses
WHERE ($1::text IS NULL OR lane = $1) AND ($2::text IS NULL OR tenant = $2)
RETURNING {COLUMNS}
"""
# A timed pause that ran out. Every replica's watch, and every pause and resume, may run
# this at once: a row is deleted by one transaction only (a second DELETE waits for the
# first's commit, then finds the row gone and returns nothing), so each pause gets exactly
# one `resumed` event and one audit row, written in that deleting transaction.
EXPIRE_SQL = f"DELETE FROM queue_pauses WHERE NOT {LIVE} RETURNING {COLUMNS}"
# The watch's read: every row, and whether it is still in force (one that is not is
# expired by the reader).
WATCH_SQL = f"SELECT {COLUMNS}, {LIVE} AS live FROM queue_pauses"
EVENT_SQL = """
INSERT INTO photo_events (photo_id, type, data) VALUES ($1, $2, $3::jsonb)
RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
"""


@translated
async def active(conn: Pool | Connection) -> list[dict[str, Any]]:
    """The pauses in force now (the database's clock), everything-wide first."""
    return [dict(row) for row in await conn.fetch(ACTIVE_SQL)]


@translated
async def pause(
    pool: Pool, action: audit.Action, scope: tuple[str | None, str | None], for_s: float | None
) -> dict[str, Any]:
    """Pause `scope` (lane, tenant) until resumed or for `for_s`; the pause as stored."""
    async with pool.acquire() as conn, conn.transaction():
        await _expire(conn)
        stored = await conn.fetchrow(PAUSE_SQL, *scope, action.operator, action.reason, for_s)
        assert stored is not None  # an upsert returns its row
        row = dict(stored)
        await _event(conn, PAUSED, row)
        await audit.record(conn, action, "done", 1, {"until": row["until"]})
    return row


@translated
async def resume(
    pool: Pool, action: audit.Action, scope: tuple[str | None, str | None]
) -> list[dict[str, Any]]:
    """End every pause inside `scope`; those that were in force."""
    async with pool.acquire() as conn, conn.transaction():
        await _expire(conn)
        ended = [dict(r) for r in await conn.fetch(RESUME_SQL, *scope)]
        for row in ended:
            await _event(conn, RESUMED, {**row, "resumed_by": action.operator, "expired": False})
        detail = {"resumed": [{"lane": r["lane"], "tenant": r["tenant"]} for r in ended]}
        await audit.record(conn, action, "done", len(ended), detail)
    return ended


@translated
async def watched(pool: Pool) -> tuple[list[dict[str, Any]], bool]:
    """The pauses in force now, and whether a timed one ran out and is still to `expire`."""
    rows = [dict(row) for row in await pool.fetch(WATCH_SQL)]
    return [{k: v for k, v in r.items() if k != "live"} for r in rows if r["live"]], any(
        not r["live"] for r in rows
    )


@translated
async def expire(pool: Pool) -> list[dict[str, Any]]:
    """End the timed pauses that ran out; those this call ended (none if another did)."""
    async with pool.acquire() as conn, conn.transaction():
        return await _expire(conn)


async def _expire(conn: Connection) -> list[dict[str, Any]]:
    ended = [dict(row) for row in await conn.fetch(EXPIRE_SQL)]
    for row in ended:
        await _event(conn, RESUMED, {**row, "resumed_by": None, "expired": True})
        await audit.record(conn, _timer(row), "done", 1, {"until": row["until"]})
    return ended


def _timer(row: dict[str, Any]) -> audit.Action:
    """The automatic resume of a timed pause: under the name of who set its time."""
    return audit.Action(operator=row["operator"], via="timer", action="resume",
                        selection={"lane": row["lane"], "tenant": row["tenant"]},
                        reason="timed pause ran out")  # fmt: skip


async def _event(conn: Connection, type_: str, row: dict[str, Any]) -> None:
    await conn.execute(EVENT_SQL, NO_PHOTO, type_, json.dumps(row, default=_iso))


def _iso(value: Any) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
