"""Bulk actions' SQL: the selection grammar over photos (tenant, state, error code, created
and processed time ranges, lane, format), its exact count and sample, the snapshot of ids an
action freezes (`bulk_action_items`), its keyset batches, and the per-photo step that marks
an item and changes its photo in one transaction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Literal

import msgspec

from darkroom.store import db, erasure, lanes, publishing
from darkroom.store.db import Connection, Pool, translated
from darkroom.store.intake import FEEDABLE, INTAKE_CHANNEL

ItemState = Literal["pending", "acted", "sent", "skipped"]


class Selection(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which photos: every field named must match (None: any)."""

    tenant: str | None = None
    state: str | None = None
    code: str | None = None
    created_since: datetime | None = None
    created_until: datetime | None = None
    processed_since: datetime | None = None
    processed_until: datetime | None = None
    lane: str | None = None
    format: str | None = None
    # False: only photos not erased yet (an erase's selection when it names no state)
    erased: bool | None = None

    def as_json(self) -> dict[str, Any]:
        """The frozen form the audit trail records (and a resume reads back)."""
        return dict(msgspec.to_builtins(self))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Selection:
        fields = {k: v for k, v in raw.items() if k in cls.__struct_fields__}
        return msgspec.convert(fields, cls, strict=False)

    def empty(self) -> bool:
        return not self.as_json()


# Each filter a clause of its own: only the filters named reach the statement, so each
# selection is planned for what it asks (a `$n IS NULL OR ...` would be planned once,
# generically, past the index that serves it).
CLAUSES = {
    "tenant": "tenant = ${}",
    "state": "processing_state = ${}",
    "code": "error_code = ${}",
    "created_since": "created_at >= ${}",
    "created_until": "created_at < ${}",
    "processed_since": "processed_at >= ${}",
    "processed_until": "processed_at < ${}",
    "lane": "lane = ${}",
    "format": "format = ${}",
    "erased": "(processing_state = 'erased') = ${}",
}


def where(selection: Selection, first: int = 1) -> tuple[str, list[Any]]:
    """The WHERE text (parameters from `$first`) and its values."""
    named = [(k, getattr(selection, k)) for k in CLAUSES if getattr(selection, k) is not None]
    clauses = [CLAUSES[k].format(first + i) for i, (k, _) in enumerate(named)]
    return " AND ".join(clauses) or "true", [v for _, v in named]


@translated
async def count(pool: Pool, selection: Selection) -> int:
    """The exact number of photos selected now."""
    text, values = where(selection)
    n: int = await pool.fetchval(f"SELECT count(*) FROM photos WHERE {text}", *values)
    return n


@translated
async def sample(pool: Pool, selection: Selection, limit: int) -> list[uuid.UUID]:
    """At most `limit` selected ids (any of them: no sort of the whole selection)."""
    text, values = where(selection, 2)
    rows = await pool.fetch(f"SELECT id FROM photos WHERE {text} LIMIT $1", limit, *values)
    return [row["id"] for row in rows]


@translated
async def freeze(conn: Connection, action_id: uuid.UUID, selection: Selection) -> int:
    """Snapshot the selected ids as the action's items; how many (the exact count)."""
    text, values = where(selection, 2)
    status: str = await conn.execute(
        f"INSERT INTO bulk_action_items (action_id, photo_id) "
        f"SELECT $1, id FROM photos WHERE {text}", action_id, *values,
    )  # fmt: skip
    return int(status.split()[-1])


BATCH_SQL = """
SELECT photo_id FROM bulk_action_items
WHERE action_id = $1 AND state = $2 AND photo_id > $3
ORDER BY photo_id LIMIT $4
"""
ZERO = uuid.UUID(int=0)


@translated
async def batch(
    pool: Pool, action_id: uuid.UUID, state: ItemState, after: uuid.UUID, limit: int
) -> list[uuid.UUID]:
    """The next ids in `state` after `after`, in id order (bulk_action_items_state_idx)."""
    rows = await pool.fetch(BATCH_SQL, action_id, state, after, limit)
    return [row["photo_id"] for row in rows]


TALLY_SQL = "SELECT state, count(*) AS n FROM bulk_action_items WHERE action_id = $1 GROUP BY 1"


@translated
async def tally(pool: Pool, action_id: uuid.UUID) -> dict[str, int]:
    """How many items are in each state (the run's summary, the audit row's counts)."""
    return {row["state"]: row["n"] for row in await pool.fetch(TALLY_SQL, action_id)}


# Taking the item first locks it: a second runner of the same action waits here, then
# finds it no longer pending and acts on nothing.
TAKE_SQL = """
UPDATE bulk_action_items SET state = $3, acted_at = now()
WHERE action_id = $1 AND photo_id = $2 AND state = 'pending'
RETURNING photo_id
"""
SENT_SQL = """
UPDATE bulk_action_items SET state = 'sent'
WHERE action_id = $1 AND photo_id = ANY($2::uuid[]) AND state = 'acted'
"""

# What the action does to one photo inside the item's transaction: the item's next state
# (`acted`: hand it to its lane after the commit; `sent`: nothing more to do; `skipped`:
# it no longer qualified, nothing changed).
Act = Callable[[Connection, uuid.UUID], Awaitable[ItemState]]


@translated
async def act_group(
    pool: Pool, action_id: uuid.UUID, photo_ids: list[uuid.UUID], act: Act
) -> list[tuple[uuid.UUID, ItemState | None]]:
    """Act on these items' photos in id order, in one transaction (one commit for the group,
    a few milliseconds of row locks), each at most once per action: an item leaves
    `pending` in the transaction that changes its photo. None for an item another run of
    the action took first."""
    done: list[tuple[uuid.UUID, ItemState | None]] = []
    async with pool.acquire() as conn, conn.transaction():
        for photo_id in photo_ids:
            done.append((photo_id, await _act_once(conn, action_id, photo_id, act)))
    return done


async def _act_once(
    conn: Connection, action_id: uuid.UUID, photo_id: uuid.UUID, act: Act
) -> ItemState | None:
    if await conn.fetchval(TAKE_SQL, action_id, photo_id, "acted") is None:
        return None
    outcome = await act(conn, photo_id)
    if outcome != "acted":
        await conn.execute(_SET_SQL, action_id, photo_id, outcome)
    return outcome


_SET_SQL = "UPDATE bulk_action_items SET state = $3 WHERE action_id = $1 AND photo_id = $2"


@translated
async def mark_sent(pool: Pool, action_id: uuid.UUID, photo_ids: list[uuid.UUID]) -> None:
    await pool.execute(SENT_SQL, action_id, photo_ids)


async def retry(conn: Connection, photo_id: uuid.UUID) -> ItemState:
    """Operator retry (db.reset_failed): a failed photo becomes `uploaded`, a new run."""
    return "acted" if await db.reset_failed(conn, photo_id) else "skipped"


async def rerender(conn: Connection, photo_id: uuid.UUID) -> ItemState:
    """One more re-render generation of a processed photo (publishing.request_rerender)."""
    marked = await publishing.request_rerender(conn, [photo_id], None)
    return "acted" if marked else "skipped"


# A move records the lane and tenant ($2, $3; NULL keeps each). An unfinished photo that
# changes lane goes back to the one rule (enqueued_at NULL: the feeder or the intake puts it
# into its new lane's stream; an entry already in the old stream then ends `busy` or
# `already`); one still waiting in the bulk backlog is fed under its new tenant as it is.
MOVE_SQL = f"""
WITH moved AS (
    UPDATE photos SET lane = coalesce($2, lane), tenant = coalesce($3, tenant),
        updated_at = now(), last_activity_at = now(),
        enqueued_at = CASE WHEN coalesce($2, lane) <> lane AND {FEEDABLE} THEN NULL
                           ELSE enqueued_at END
    WHERE id = $1
    RETURNING id, enqueued_at IS NULL AND {FEEDABLE} AS to_feed
)
SELECT id, CASE WHEN to_feed THEN pg_notify('{INTAKE_CHANNEL}', id::text) END FROM moved
"""


def eraser(selected: Selection) -> Act:
    """The erase of a photo that still matches the selection (the row locked first), in
    the item's transaction: its objects are the hand-over's to delete after the commit (no
    render of it can publish from then on)."""
    text, values = where(selected, 2)
    still = f"SELECT 1 FROM photos WHERE id = $1 AND {text} FOR UPDATE"

    async def erase(conn: Connection, photo_id: uuid.UUID) -> ItemState:
        if await conn.fetchval(still, photo_id, *values) is None:
            return "skipped"
        return "acted" if await erasure.erase_row(conn, photo_id) else "skipped"

    return erase


def feeding(act: Act, lane: str | None) -> Act:
    """The act, then, for a photo whose lane (`lane`, else its own) is bulk, the hand-over
    to the feeder in the same transaction (lanes.to_feeder): nothing is left to do after
    the commit, so no kill can land between the act and the hand-over. An interactive
    photo stays `acted`: its XADD follows the commit."""

    async def act_and_feed(conn: Connection, photo_id: uuid.UUID) -> ItemState:
        outcome = await act(conn, photo_id)
        if outcome != "acted" or (lane or await lanes.lane_of(conn, photo_id)) != "bulk":
            return outcome
        return "sent" if await lanes.to_feeder(conn, photo_id) else outcome

    return act_and_feed


def mover(lane: str | None, tenant: str | None) -> Act:
    """The move to `lane` and/or `tenant` as an Act."""

    async def move(conn: Connection, photo_id: uuid.UUID) -> ItemState:
        moved = await conn.fetchval(MOVE_SQL, photo_id, lane, tenant)
        return "sent" if moved is not None else "skipped"

    return move


# An action's frozen form is its `started` row in the audit trail (operator_actions is
# append-only, so what a resume reads is what the first run recorded).
STARTED_SQL = """
SELECT action_id, action, selection, reason FROM operator_actions
WHERE action_id = $1 AND outcome = 'started' ORDER BY id LIMIT 1
"""
# The newest action of this verb and selection that has not ended, started within a day: a
# rerun with the same flags continues it. An older one is an incident long past; continuing
# its frozen list would skip what failed since (the count shown is the live one), so a rerun
# then starts afresh and only `--resume ACTION_ID` continues it. Operator actions are few
# (one row per command run), so this reads the trail's rows of the verb, never photos.
UNFINISHED_SQL = """
SELECT s.action_id FROM operator_actions s
WHERE s.action = $1 AND s.outcome = 'started' AND s.selection = $2::jsonb
  AND s.at > now() - interval '1 day'
  AND NOT EXISTS (SELECT 1 FROM operator_actions e
                  WHERE e.action_id = s.action_id AND e.outcome IN ('done', 'failed'))
ORDER BY s.id DESC LIMIT 1
"""


@translated
async def started(pool: Pool, action_id: uuid.UUID) -> dict[str, Any] | None:
    """The action's `started` row (its verb, frozen selection and reason); None: unknown."""
    row = await pool.fetchrow(STARTED_SQL, action_id)
    return None if row is None else {**dict(row), "selection": json.loads(row["selection"])}


@translated
async def unfinished(pool: Pool, action: str, frozen: dict[str, Any]) -> uuid.UUID | None:
    """The action a rerun of the same verb and selection continues; None: start anew."""
    found: uuid.UUID | None = await pool.fetchval(
        UNFINISHED_SQL, action, json.dumps(frozen, default=str)
    )
    return found
