"""The operator's audit trail in PostgreSQL (`operator_actions`): one row per operator action,
who took it, through what, on which selection, how many photos, why and how it ended; and
the reads behind `darkroom audit` and the page's audit view. Rows are only inserted: an
action that runs long writes `started`, then its ending under the same `action_id`.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, Literal

import msgspec

from darkroom.store.db import Connection, Pool, translated

# `timer`: what an operator set to happen later (a timed pause running out).
Via = Literal["cli", "page", "api", "timer"]
Outcome = Literal["started", "done", "dry_run", "refused", "failed", "interrupted"]
REASON_MAX_CHARS = 2000


class Action(msgspec.Struct, frozen=True, kw_only=True):
    """What the operator asked for: `action` a verb such as `pause`, `dlq.replay` or `gc`;
    `selection` the scope or query it acts on (JSON-able)."""

    operator: str
    via: Via
    action: str
    selection: dict[str, Any] = msgspec.field(default_factory=dict)
    reason: str | None = None
    action_id: uuid.UUID = msgspec.field(default_factory=uuid.uuid4)


INSERT_SQL = """
INSERT INTO operator_actions (action_id, operator, via, action, selection, count, reason,
                              outcome, detail)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9::jsonb)
RETURNING id
"""


@translated
async def record(
    conn: Pool | Connection,
    action: Action,
    outcome: Outcome,
    count: int | None = None,
    detail: dict[str, Any] | None = None,
) -> int:
    """One row of the trail; pass the transaction's connection so the row commits (or not)
    with what it records."""
    reason = action.reason[:REASON_MAX_CHARS] if action.reason else None
    row_id: int = await conn.fetchval(
        INSERT_SQL, action.action_id, action.operator, action.via, action.action,
        json.dumps(action.selection, default=str), count, reason, outcome,
        None if detail is None else json.dumps(detail, default=str),
    )  # fmt: skip
    return row_id


# Newest first, keyset by (at, id): a page costs O(limit) however deep, on
# operator_actions_at_idx, or operator_actions_action_at_idx with an action. No `$n IS
# NULL OR` in either: a generic plan could not use the index for such a condition (the
# missing bounds are infinities instead).
SINCE_SQL = """
SELECT id, action_id, at, operator, via, action, selection, count, reason, outcome, detail
FROM operator_actions
WHERE at >= coalesce($1, '-infinity'::timestamptz)
  AND (at, id) < (coalesce($3, 'infinity'::timestamptz), coalesce($4, 0::bigint))
  {action}
ORDER BY at DESC, id DESC
LIMIT $2
"""
ALL_SQL = SINCE_SQL.format(action="")
ONE_ACTION_SQL = SINCE_SQL.format(action="AND action = $5")


@translated
async def since(
    pool: Pool,
    when: datetime | None,
    limit: int,
    action: str | None = None,
    before: tuple[datetime, int] | None = None,
) -> list[dict[str, Any]]:
    """Rows at or after `when` (all without), newest first, at most `limit`; `before`
    (a row's `at` and `id`): only rows older than that one, the next page."""
    at, row_id = before or (None, None)
    args = (when, limit, at, row_id)
    if action is None:
        rows = await pool.fetch(ALL_SQL, *args)
    else:
        rows = await pool.fetch(ONE_ACTION_SQL, *args, action)
    return [_decoded(dict(row)) for row in rows]


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    for column in ("selection", "detail"):
        if row[column] is not None:
            row[column] = json.loads(row[column])
    return row
