"""PostgreSQL of the lanes: a photo's lane and tenant, handing a photo to the feeder, and
the sweep's fenced take of a lost photo before it goes back into its lane.

The one rule (docs/lanes.md): an unfinished photo whose `enqueued_at` is NULL is put into
its lane's stream by the feeder. So a bulk (re-)enqueue is `enqueued_at = NULL` plus a
NOTIFY on `darkroom_intake`, never an XADD; an interactive one XADDs, then
db.record_requeued sets `enqueued_at`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from darkroom.store.db import Connection, Pool, translated
from darkroom.store.duties import Fence, fenced
from darkroom.store.intake import FEEDABLE, INTAKE_CHANNEL

# A new photo; an interactive one counts as enqueued now (its producer XADDs it next, and
# the feeder must not), a bulk one is the feeder's at once: schema.sql's photos_intake_notify
# trigger wakes the feeder at commit (it notifies every insert with enqueued_at NULL).
INSERT_SQL = """
INSERT INTO photos (id, original_key, lane, tenant, cost, enqueued_at, traceparent)
VALUES ($1, $2, $3, $4, $5, CASE WHEN $3 = 'interactive' THEN now() END, $6)
"""

# Into the bulk lane, for the feeder: not enqueued any more, and fresh for the sweep (the
# feeder's XADD is what shows progress next). Only an unfinished photo: one to process, or
# a processed one with a re-render requested. The lane and tenant ($2, NULL keeps it)
# change in the same statement as the check: a photo refused keeps both. The id
# (pg_notify's value is void, NULL to a client: it cannot tell a hand-over from none), or
# no row.
TO_FEEDER_SQL = f"""
WITH photo AS (
    UPDATE photos SET lane = 'bulk', tenant = coalesce($2, tenant), enqueued_at = NULL,
        last_activity_at = now(),
        updated_at = CASE WHEN (lane, tenant) IS DISTINCT FROM ('bulk', coalesce($2, tenant))
                          THEN now() ELSE updated_at END
    WHERE id = $1 AND {FEEDABLE}
    RETURNING id
)
SELECT id, pg_notify('{INTAKE_CHANNEL}', id::text) FROM photo
"""

# The lane and tenant an operator names (a NULL keeps the photo's own).
SET_LANE_SQL = """
UPDATE photos SET lane = coalesce($2, lane), tenant = coalesce($3, tenant), updated_at = now()
WHERE id = $1
RETURNING lane
"""

LANE_SQL = "SELECT lane FROM photos WHERE id = $1"

# Before the sweep re-enqueues a photo it judged lost: still unfinished, untouched since
# the pass's horizon ($2), and the sweep's duty still held ($3..$5). It moves
# last_activity_at, so the photo is not judged again for DARKROOM_SWEEP_AFTER_S: a sweep
# killed before its requeue delays the photo by that much, never loses it.
TAKE_LOST_SQL = f"""
WITH fence AS (SELECT {fenced(3)} AS held),
taken AS (
    UPDATE photos SET last_activity_at = now()
    WHERE id = $1 AND processing_state IN ('uploaded', 'processing') AND last_activity_at < $2
      AND (SELECT held FROM fence)
    RETURNING id
)
SELECT CASE WHEN NOT (SELECT held FROM fence) THEN 'refused'
            WHEN EXISTS (SELECT 1 FROM taken) THEN 'taken' ELSE 'moved' END
"""
Taken = Literal["taken", "moved", "refused"]


@translated
async def insert_photo(
    pool: Pool,
    photo_id: uuid.UUID,
    original_key: str,
    lane: str,
    tenant: str,
    cost: int | None,
    traceparent: str | None = None,
) -> None:
    """`traceparent`: the producer's trace context (docs/tracing.md), None untraced."""
    await pool.execute(INSERT_SQL, photo_id, original_key, lane, tenant, cost, traceparent)


@translated
async def to_feeder(
    conn: Pool | Connection, photo_id: uuid.UUID, tenant: str | None = None
) -> bool:
    """Hand an unfinished photo to the feeder, in the bulk lane (and `tenant`, if named);
    False if it is finished or gone, and then nothing changed."""
    return await conn.fetchval(TO_FEEDER_SQL, photo_id, tenant) is not None


@translated
async def set_lane(
    pool: Pool, photo_id: uuid.UUID, lane: str | None, tenant: str | None
) -> str | None:
    """Record the lane and tenant named (None keeps each); the photo's lane, None if gone."""
    lane_now: str | None = await pool.fetchval(SET_LANE_SQL, photo_id, lane, tenant)
    return lane_now


@translated
async def lane_of(conn: Pool | Connection, photo_id: uuid.UUID) -> str | None:
    """The photo's lane; None if it is gone."""
    lane: str | None = await conn.fetchval(LANE_SQL, photo_id)
    return lane


@translated
async def take_lost(
    conn: Pool | Connection, photo_id: uuid.UUID, before: datetime, fence: Fence
) -> Taken:
    """`taken`: re-enqueue it; `moved`: it made progress since the page was read (or
    finished), leave it; `refused`: the sweep's duty is lost, nothing was written."""
    outcome: Taken = await conn.fetchval(TAKE_LOST_SQL, photo_id, before, *fence.args)
    return outcome
