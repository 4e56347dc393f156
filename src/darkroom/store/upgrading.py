"""Upgrading a published photo in PostgreSQL: the one statement that adds its deferred
renditions (AVIF by default) to the manifest its last publish wrote, with its
`darkroom.photo.upgraded` event and history row in the same commit, fenced by the lease
token of the claim that rendered them; the failure of an upgrade, fenced the same way; and
the sweep's look for upgrades whose entry was lost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from darkroom.store import keys, publishing
from darkroom.store.db import Pool, translated
from darkroom.store.duties import Fence, fenced
from darkroom.store.publishing import AttemptRow

# Fenced as PUBLISH_SQL: only the job's current lease ($3, the token its claim was granted,
# the job still active) writes. Every publish, re-render and erase of the photo claims or
# revokes that one job first, so its token moves on: an upgrade rendered for an older
# manifest (a re-render published since) or for an erased photo matches no lease and adds
# nothing. The upgrade adds its renditions beside the manifest's (one of the same name and
# format is replaced: its key is returned, for deletion after the commit), clears the
# request, and answers no re-render: one requested meanwhile (its entry met this lease as
# `busy` and was acked) is still to do, so `enqueued_at` is cleared and `again` says so.
# `lost`: the entry ($4) belongs to a newer lease, which acks it itself.
UPGRADE_SQL = """
WITH old AS (
    SELECT id, renditions, processing_state AS was FROM photos WHERE id = $1 FOR UPDATE
), lease AS (
    SELECT j.id FROM photo_jobs j JOIN old ON j.photo_id = old.id
    WHERE j.photo_id = $1 AND j.type = 'process' AND j.state = 'active'
      AND j.lease_token = $3
    FOR UPDATE OF j
), kept AS (
    SELECT coalesce(jsonb_agg(r ORDER BY n), '[]'::jsonb) AS renditions,
           (SELECT jsonb_agg(r2) FROM old o2, jsonb_array_elements(o2.renditions) r2
            WHERE EXISTS (SELECT 1 FROM jsonb_array_elements($2::jsonb) a
                          WHERE a->>'name' = r2->>'name' AND a->>'format' = r2->>'format'))
           AS replaced
    FROM old, jsonb_array_elements(coalesce(old.renditions, '[]'::jsonb))
         WITH ORDINALITY AS e(r, n)
    WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements($2::jsonb) a
                      WHERE a->>'name' = r->>'name' AND a->>'format' = r->>'format')
), photo AS (
    UPDATE photos SET renditions = kept.renditions || $2::jsonb,
        upgrade_requested_at = NULL,
        enqueued_at = CASE WHEN rerender_requested_at IS NOT NULL THEN NULL
                           ELSE enqueued_at END,
        updated_at = now(), last_activity_at = now()
    FROM old, lease, kept
    WHERE photos.id = $1 AND old.id = $1 AND processing_state = 'processed'
      AND upgrade_requested_at IS NOT NULL
    RETURNING photos.id, kept.replaced, photos AS changed, photos.lane,
              photos.rerender_requested_at IS NOT NULL AS again
), job AS (
    UPDATE photo_jobs SET state = 'done', error_code = NULL, last_error = NULL,
        next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
    WHERE photo_id = $1 AND type = 'process' AND lease_token = $3
      AND EXISTS (SELECT 1 FROM photo)
), event AS (
    -- none when nothing was added (the deferred list was emptied since the request): the
    -- request is answered, but a gallery has nothing new to fetch
    INSERT INTO photo_events (photo_id, type, data)
    SELECT id, 'darkroom.photo.upgraded', darkroom_event_data(changed, NULL, NULL) FROM photo
    WHERE jsonb_array_length($2::jsonb) > 0
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
), attempt AS (
""" + publishing.published_and_answered("upgraded", attempt=5, entry=4)

Status = Literal["upgraded", "lost", "already", "erased"]
NO_ROW = AttemptRow()


@dataclass(frozen=True)
class Upgraded:
    """`upgraded`: the keys of renditions it replaced (of the same name and format), and
    `again` when a re-render requested meanwhile is still to do (through `lane`). Refused:
    `lost`, `already` (a publish, re-render or another upgrade came first) or `erased`."""

    status: Status
    replaced: list[str] = field(default_factory=list)
    again: bool = False
    lane: str | None = None


@translated
async def publish_upgrade(
    pool: Pool,
    photo_id: uuid.UUID,
    renditions_json: str,
    lease: tuple[int, str],
    attempt: AttemptRow = NO_ROW,
) -> Upgraded:
    """Add the deferred renditions under the lease (token, entry id) that rendered them."""
    row = await pool.fetchrow(
        UPGRADE_SQL, photo_id, renditions_json, *lease, attempt.row_id, attempt.download_ms,
        attempt.render_ms, attempt.upload_ms, attempt.peak_rss_mb,
    )  # fmt: skip
    assert row is not None
    return Upgraded(row["status"], keys.keys_of(row["replaced"]), row["again"], row["lane"])


# An upgrade that failed for good, by the lease holder: the job records it, the photo keeps
# the renditions it has (published, its fast ones) and the request is answered (dropped: a
# render that fails once for good fails again). No event: nothing a gallery shows changed.
UPGRADE_FAILED_SQL = """
WITH p AS (
    SELECT id FROM photos WHERE id = $1 AND processing_state = 'processed'
      AND upgrade_requested_at IS NOT NULL FOR UPDATE
), job AS (
    UPDATE photo_jobs j SET state = 'failed', error_code = $2, last_error = $3,
        next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
    FROM p WHERE j.photo_id = p.id AND j.type = 'process' AND j.state = 'active'
      AND j.lease_token = $4
    RETURNING j.photo_id, j.generation
)
UPDATE photos SET upgrade_requested_at = NULL, updated_at = now(), last_activity_at = now(),
    enqueued_at = CASE WHEN photos.rerender_requested_at IS NOT NULL
                        AND photos.rerender_generation > job.generation
                       THEN NULL ELSE photos.enqueued_at END
FROM job WHERE photos.id = job.photo_id
RETURNING photos.rerender_requested_at IS NOT NULL
      AND photos.rerender_generation > job.generation AS again
"""

UpgradeFailed = Literal["dropped", "again", "not_recorded"]


@translated
async def record_upgrade_failure(
    pool: Pool, photo_id: uuid.UUID, token: int, code: str, message: str
) -> UpgradeFailed:
    """The upgrade of this lease failed for good: its request is dropped and the photo keeps
    what it published (no event: nothing a reader sees changed). `again` when a re-render
    was requested that this upgrade's render did not answer: the photo is to go through
    again (its `enqueued_at` cleared for the feeder). `not_recorded`: no upgrade of this
    lease (refused; nothing changed)."""
    again = await pool.fetchval(UPGRADE_FAILED_SQL, photo_id, code, message[:2000], token)
    return "not_recorded" if again is None else "again" if again else "dropped"


# The sweep's look for upgrades whose entry never reached the bulk stream (a worker gone
# between its publish's commit and its XADD, or Redis failing that XADD), under the sweep's
# duty ($4..$6): requested before the pass's horizon ($1) and before the oldest entry still
# in the bulk stream ($2, its time in ms less the clocks' margin, $3; NULL: the stream is
# empty), so every entry added after the request has been taken and acked, and no job of the
# photo is active or pending (a running or retrying upgrade holds its own entry). The
# request's time moves on, so the photo is not judged again before another horizon.
# photos_upgrade_due_idx.
LOST_SQL = f"""
WITH fence AS (SELECT {fenced(4)} AS held),
lost AS (
    SELECT p.id FROM photos p
    WHERE p.upgrade_requested_at IS NOT NULL AND p.processing_state = 'processed'
      AND p.upgrade_requested_at < $1
      AND ($2::bigint IS NULL OR p.upgrade_requested_at < to_timestamp(($2 - $3) / 1000.0))
      AND NOT EXISTS (SELECT 1 FROM photo_jobs j WHERE j.photo_id = p.id AND j.type = 'process'
                      AND j.state IN ('active', 'pending'))
      AND (SELECT held FROM fence)
    ORDER BY p.upgrade_requested_at, p.id LIMIT $7
    FOR UPDATE OF p SKIP LOCKED
), taken AS (
    UPDATE photos SET upgrade_requested_at = now(), last_activity_at = now()
    FROM lost WHERE photos.id = lost.id
    RETURNING photos.id, photos.traceparent
)
SELECT (SELECT held FROM fence) AS held, id, traceparent FROM taken
UNION ALL SELECT false, NULL, NULL WHERE NOT (SELECT held FROM fence)
"""


@translated
async def take_lost(
    pool: Pool, before: datetime, oldest_ms: int | None, margin_ms: int, fence: Fence, limit: int
) -> dict[uuid.UUID, str] | None:
    """The photos whose upgrade has no entry (their request's time moved to now), each
    with the trace context its entry carries: the sweep's to XADD again. None: refused,
    the fence no longer holds (nothing was taken)."""
    rows = await pool.fetch(LOST_SQL, before, oldest_ms, margin_ms, *fence.args, limit)
    if any(not row["held"] for row in rows):
        return None
    return {row["id"]: row["traceparent"] or "" for row in sorted(rows, key=lambda r: r["id"])}
