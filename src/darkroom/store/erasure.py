"""Erasing photos in PostgreSQL: the one statement that makes photos `erased` (their
identifying facts and renditions nulled, their job's lease revoked, their event written)
in the same transaction as the operator's audit row; and the storage keys that are then
the erase's to delete.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from darkroom.store import audit
from darkroom.store.db import Connection, Pool, translated

# Photos are locked in id order (two erases of overlapping lists never deadlock), each
# before its job, as every statement that changes both does. Revoking the lease is what
# makes an erase win over a render in flight: the job's token moves on and the job is no
# longer active, so its holder's publish, retry, failure and heartbeat match no row
# (PUBLISH_SQL answers `erased`), and its entry's next claim is `skipped` (CLAIM_SQL).
# Nulled: what identifies a person or a place (capture time, GPS, camera and lens, the
# original's hash, which matches a copy of it, and the placeholder and colour drawn from
# its pixels); kept: the technical shape (size, format, frames, alpha, HDR kind). The same
# facts leave the photo's earlier events (`photo_events`: the outbox, which the relay may
# not have sent yet, and what `darkroom events` replays for DARKROOM_EVENTS_KEEP_DAYS).
# An erased photo is not erased again (`was` tells the caller); its row is still returned,
# so a re-run deletes whatever objects a failed first run left.
ERASE_SQL = """
WITH p AS (
    SELECT id, processing_state AS was, original_key FROM photos
    WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE
), job AS (
    UPDATE photo_jobs j SET lease_token = j.lease_token + 1,
        state = CASE WHEN j.state IN ('pending', 'active') THEN 'done' ELSE j.state END,
        holder = NULL, lease_until = NULL, next_retry_at = NULL, transient_since = NULL,
        finished_at = coalesce(j.finished_at, now()), updated_at = now()
    FROM p WHERE j.photo_id = p.id AND j.type = 'process' AND p.was <> 'erased'
), photo AS (
    UPDATE photos SET processing_state = 'erased', visibility = 'unpublished',
        erased_at = now(), renditions = NULL, error_code = NULL,
        taken_at_local = NULL, taken_at = NULL, latitude = NULL, longitude = NULL,
        camera_make = NULL, camera_model = NULL, lens_model = NULL, exposure = NULL,
        original_sha256 = NULL, thumbhash = NULL, dominant_color = NULL,
        rerender_requested_at = NULL, updated_at = now(), last_activity_at = now()
    FROM p WHERE photos.id = p.id AND p.was <> 'erased'
    RETURNING photos AS changed
), scrubbed AS (
    UPDATE photo_events e SET data = e.data - 'facts' - 'thumbhash' - 'dominant_color'
    FROM p WHERE e.photo_id = p.id AND p.was <> 'erased'
), event AS (
    INSERT INTO photo_events (photo_id, type, data)
    SELECT (changed).id, 'darkroom.photo.erased', darkroom_event_data(changed, NULL, NULL)
    FROM photo
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
)
SELECT id, was, original_key, (SELECT count(*) FROM event) AS events FROM p ORDER BY id
"""

# What an erase would do, read without locks (a dry run changes nothing).
LOOK_SQL = """
SELECT id, processing_state AS was, original_key FROM photos
WHERE id = ANY($1::uuid[]) ORDER BY id
"""


@dataclass(frozen=True)
class Erased:
    """Of the ids asked for: those erased by this commit, those already erased before it
    (`already`), those with no row (`missing`); and each found photo's original key (its
    storage is the caller's to delete: after the commit, so no publish can follow it)."""

    erased: list[uuid.UUID] = field(default_factory=list)
    already: list[uuid.UUID] = field(default_factory=list)
    missing: list[uuid.UUID] = field(default_factory=list)
    originals: dict[uuid.UUID, str] = field(default_factory=dict)

    @property
    def found(self) -> list[uuid.UUID]:
        return sorted(self.originals)

    def detail(self) -> dict[str, Any]:
        """The audit row's detail."""
        return {"erased": self.erased, "already": self.already, "missing": self.missing}


@translated
async def erase(
    pool: Pool, photo_ids: list[uuid.UUID], action: audit.Action, dry_run: bool = False
) -> Erased:
    """Erase these photos in one transaction with the action's `started` audit row (its
    ending follows once the objects are deleted), or, a dry run, its `dry_run` row and
    nothing changed."""
    async with pool.acquire() as conn, conn.transaction():
        rows = await conn.fetch(LOOK_SQL if dry_run else ERASE_SQL, photo_ids)
        found = _erased(photo_ids, rows)
        outcome: audit.Outcome = "dry_run" if dry_run else "started"
        await audit.record(conn, action, outcome, len(found.erased), found.detail())
    return found


async def erase_row(conn: Connection, photo_id: uuid.UUID) -> bool:
    """Erase one photo in the caller's transaction (a bulk erase's item, whose audit rows
    are the action's): True if this commit erases it, False if it was erased already or
    has no row."""
    rows = await conn.fetch(ERASE_SQL, [photo_id])
    return bool(rows) and rows[0]["was"] != "erased"


@translated
async def original_key(pool: Pool, photo_id: uuid.UUID) -> str | None:
    """The photo's original's key (an erase keeps it in the row: its object is the
    erase's to delete with `--original`); None: no row."""
    key: str | None = await pool.fetchval("SELECT original_key FROM photos WHERE id = $1", photo_id)
    return key


def _erased(asked: list[uuid.UUID], rows: list[Any]) -> Erased:
    seen = {row["id"]: row for row in rows}
    return Erased(
        erased=[r["id"] for r in rows if r["was"] != "erased"],
        already=[r["id"] for r in rows if r["was"] == "erased"],
        missing=sorted(set(asked) - set(seen)),
        originals={r["id"]: r["original_key"] for r in rows},
    )
