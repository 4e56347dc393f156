"""Publishing a photo in PostgreSQL: the one statement that switches a photo's row to its
new renditions and facts (with its event and history row, in the same commit), fenced by
the lease token of the claim that rendered it; and the re-render requests it answers, as
generations.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from darkroom.store import keys
from darkroom.store.db import Connection, Pool, translated
from darkroom.store.entries import appended


def published_and_answered(done: str, attempt: int, entry: int) -> str:
    """The end a fenced publish shares with the upgrade's: the delivery's history row
    (${attempt}, its stage times the four parameters after it) finished as `published` when
    `photo` changed, and the statement's answer: `done`, `erased`, `lost` (no lease matched:
    another lease has the job through this same entry, ${entry}, and acks it) or `already`
    (the entry is noted dropped, and acked by its worker)."""
    d, r, u, m = (f"${attempt + n}" for n in range(1, 5))
    return f"""    UPDATE photo_attempts SET ended_at = now(), outcome = 'published',
        download_ms = {d}, render_ms = {r}, upload_ms = {u}, peak_rss_mb = {m},
        publish_ms = extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000
    WHERE id = ${attempt} AND EXISTS (SELECT 1 FROM photo)
), latest AS (
    -- refused: the job as it is now (locked after the photo, as by the claim), not as this
    -- statement's snapshot saw it before the photo's lock was granted
    SELECT j.id, coalesce(j.state IN ('active', 'pending') AND j.stream_entry = ${entry}, false)
           AS taken
    FROM photo_jobs j
    WHERE j.photo_id = $1 AND j.type = 'process' AND NOT EXISTS (SELECT 1 FROM photo)
      AND NOT EXISTS (SELECT 1 FROM lease)
      AND NOT EXISTS (SELECT 1 FROM old WHERE was = 'erased')
    FOR UPDATE OF j
), dropped AS (
    -- `already`: its worker acks the entry, so a worker that read it before and claims it
    -- later takes nothing (leases.CLAIM_SQL, `spent`)
    UPDATE photo_jobs j SET dropped_entries = {appended("$" + str(entry))}
    FROM latest WHERE j.id = latest.id AND NOT latest.taken
)
SELECT CASE
    WHEN EXISTS (SELECT 1 FROM photo) THEN '{done}'
    WHEN EXISTS (SELECT 1 FROM old WHERE was = 'erased') THEN 'erased'
    WHEN EXISTS (SELECT 1 FROM latest WHERE taken) THEN 'lost'
    ELSE 'already' END AS status,
    (SELECT min(replaced::text) FROM photo) AS replaced,
    coalesce((SELECT bool_or(again) FROM photo), false) AS again,
    (SELECT min(lane) FROM photo) AS lane
"""


# A first render moves `processing` → `processed` and publishes. A re-render (a processed
# photo with a request) replaces renditions and facts in place: the photo stays processed,
# keeps its visibility and `processed_at`, and gets `rerendered_at`. `old` locks the row
# first, so `replaced` is exactly the renditions value this commit switched away from
# (the caller deletes the keys it no longer references, after the commit).
# Fenced: only the job's current lease ($27, the token its claim was granted, the job still
# active) publishes; a holder that froze past its lease and was replaced changes nothing.
# The requests it answers are those up to the generation its claim recorded: one made
# during the render stays, with `enqueued_at` cleared so that the photo goes through again
# (`again`). Renditions it left out for an upgrade ($31) are requested with it: any publish
# starts its render's upgrade afresh (or ends the one of a render it replaced).
# `lost`: the entry ($28) belongs to a newer lease, which acks it itself: it holds
# the job (active), or left it pending through this entry (a retry's backoff, a release).
PUBLISH_SQL = """
WITH old AS (
    SELECT id, renditions, processing_state AS was FROM photos WHERE id = $1 FOR UPDATE
), lease AS (
    SELECT j.generation FROM photo_jobs j JOIN old ON j.photo_id = old.id
    WHERE j.photo_id = $1 AND j.type = 'process' AND j.state = 'active'
      AND j.lease_token = $27
    FOR UPDATE OF j
), photo AS (
    UPDATE photos SET processing_state = 'processed',
        visibility = CASE WHEN processing_state = 'processed' THEN visibility
                          ELSE 'published' END,
        width = $2, height = $3, format = $4, bytes = $5, renditions = $6::jsonb,
        taken_at_local = $7, taken_at = $8, camera_make = $9, camera_model = $10,
        lens_model = $11, exposure = $12::jsonb, original_sha256 = $13, has_alpha = $14,
        frames = $15, source_profile = $16, latitude = $17, longitude = $18,
        thumbhash = $19, dominant_color = $20,
        hdr = $21, focal_x = $29, focal_y = $30,
        upgrade_requested_at = CASE WHEN $31 THEN now() END,
        rerendered_at = CASE WHEN processing_state = 'processed' THEN now()
                             ELSE rerendered_at END,
        rerender_requested_at = CASE WHEN rerender_generation > lease.generation
                                     THEN rerender_requested_at END,
        enqueued_at = CASE WHEN rerender_generation > lease.generation THEN NULL
                           ELSE enqueued_at END,
        error_code = NULL, processed_at = coalesce(processed_at, now()), updated_at = now(),
        last_activity_at = now()
    FROM old, lease
    WHERE photos.id = $1 AND old.id = $1
      AND (processing_state = 'processing'
           OR (processing_state = 'processed' AND rerender_requested_at IS NOT NULL))
    RETURNING photos.id, old.renditions AS replaced, old.was, photos.lane,
              photos AS changed, photos.rerender_requested_at IS NOT NULL AS again
), job AS (
    UPDATE photo_jobs SET state = 'done', error_code = NULL, last_error = NULL,
        next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
    WHERE photo_id = $1 AND type = 'process' AND lease_token = $27
      AND EXISTS (SELECT 1 FROM photo)
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
""" + published_and_answered("published", attempt=22, entry=28)

Status = Literal["published", "lost", "already", "erased"]


@dataclass(frozen=True)
class AttemptRow:
    """A delivery's `running` history row, for the publishing commit to finish (PUBLISH_SQL's
    `attempt`): its id (None: no row) and the stage times and peak RSS measured so far."""

    row_id: int | None = None
    download_ms: float | None = None
    render_ms: float | None = None
    upload_ms: float | None = None
    peak_rss_mb: float | None = None


@dataclass(frozen=True)
class Published:
    """`published`: the keys of the renditions it replaced (none on a first render), and
    `again` when a re-render requested during the render is still to do. Refused: `lost`
    (a newer lease holds the job through this same entry: the entry is its to ack) or
    `already` (the photo was finished by another delivery, or this entry is a stale
    duplicate) or `erased` (`darkroom erase` committed first: its lease was revoked)."""

    status: Status
    replaced: list[str] = field(default_factory=list)
    again: bool = False
    lane: str | None = None  # the photo's, once published


@translated
async def publish(
    pool: Pool,
    photo_id: uuid.UUID,
    facts: dict[str, Any],
    renditions_json: str,
    lease: tuple[int, str],
    attempt: AttemptRow = AttemptRow(),
    deferred: bool = False,
) -> Published:
    """Publish in one transaction under the lease (token, entry id) that rendered it, only
    from `processing` (or a requested re-render). A published photo's `attempt` row is
    finished in the same commit. `deferred`: renditions were left for an upgrade."""
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
        *lease,
        facts.get("focal_x"),  # $29, $30: after the lease, so no earlier number moves
        facts.get("focal_y"),
        deferred,
    )
    assert row is not None
    return Published(row["status"], keys.keys_of(row["replaced"]), row["again"], row["lane"])


# the facts columns, in PUBLISH_SQL's parameter order ($7 onwards)
FACT_COLUMNS = (
    "taken_at_local", "taken_at", "camera_make", "camera_model", "lens_model", "exposure",
    "original_sha256", "has_alpha", "frames", "source_profile", "latitude", "longitude",
    "thumbhash", "dominant_color", "hdr",
)  # fmt: skip


# A request is a generation: each one counts up `rerender_generation`, and a render
# answers the requests up to the generation its claim recorded (PUBLISH_SQL), so a request
# made while a render runs is rendered again, once, instead of being cleared with it.
REQUEST_RERENDER_SQL = """
UPDATE photos SET rerender_requested_at = now(), rerender_generation = rerender_generation + 1,
    updated_at = now()
WHERE processing_state = 'processed'
  AND (id = ANY($1::uuid[]) OR ($2::timestamptz IS NOT NULL AND processed_at >= $2))
RETURNING id
"""


@translated
async def request_rerender(
    pool: Pool | Connection, photo_ids: list[uuid.UUID], since: datetime | None
) -> list[uuid.UUID]:
    """Mark processed photos (these, or all processed since a time) for a re-render; the
    ids that were marked. Photos in any other state are left alone."""
    rows = await pool.fetch(REQUEST_RERENDER_SQL, photo_ids, since)
    return sorted(row["id"] for row in rows)
