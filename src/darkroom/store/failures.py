"""What a lease holder's failed delivery writes under its lease: a retry with its backoff, a
final failure (and its dead-letter outcome), a failed re-render. Each is conditioned on the
claim's fencing token like every other write of a holder (store/leases.py): a claim by
anyone since makes it match no row, and the refusal is the answer it returns.
"""

from __future__ import annotations

import uuid
from typing import Literal

from darkroom.store.db import Pool, translated

# A retry is recorded by the lease holder alone: the token its claim was granted. A stale
# delivery (its photo re-enqueued and claimed through another entry since, or its entry
# reclaimed by another process) changes nothing. The attempt its claim counted stands.
RETRY_SQL = """
WITH job AS (
UPDATE photo_jobs SET state = 'pending', error_code = $2, last_error = $3,
    next_retry_at = now() + $4 * interval '1 millisecond', transient_since = NULL,
    updated_at = now()
WHERE photo_id = $1 AND type = 'process' AND state = 'active' AND lease_token = $5
RETURNING photo_id
)
-- The photo's last activity moves with its job (the sweeper's keyset column). Every other
-- statement locks the photo before the job: SKIP LOCKED keeps this job-first one from
-- deadlocking with them, and whoever holds the photo sets last_activity_at itself.
, photo AS (
UPDATE photos SET last_activity_at = now()
WHERE id IN (SELECT id FROM photos WHERE id = $1 AND EXISTS (SELECT 1 FROM job)
             FOR UPDATE SKIP LOCKED)
)
SELECT count(*) FROM job
"""


@translated
async def record_retry(
    pool: Pool, photo_id: uuid.UUID, token: int, code: str, message: str, delay_ms: int
) -> bool:
    """False when the lease of `token` is lost (nothing is changed then)."""
    changed = await pool.fetchval(RETRY_SQL, photo_id, code, message[:2000], delay_ms, token)
    return bool(changed)


# A final failure only by the lease holder ($4: its token), the job still `active`. A
# process that lost the entry to another consumer (XAUTOCLAIM after a lost heartbeat)
# cannot fail the photo its new owner is publishing; a stale duplicate of a photo
# re-enqueued through a newer entry cannot fail it either. One statement: the photo is
# locked first, as by every other statement that changes both.
FAIL_SQL = """
WITH p AS (
    SELECT id, processing_state IN ('uploaded', 'processing') AS open
    FROM photos WHERE id = $1 FOR UPDATE
), j AS (
    -- locked after the photo, so this is the job as it is now: a claim that took it over
    -- meanwhile (under the photo's lock) has committed
    SELECT jobs.stream_entry, jobs.lease_token = $4 AND jobs.state = 'active' AS owned
    FROM photo_jobs jobs JOIN p ON jobs.photo_id = p.id
    WHERE jobs.photo_id = $1 AND jobs.type = 'process'
    FOR UPDATE OF jobs
), job AS (
    UPDATE photo_jobs SET state = 'failed', error_code = $2, last_error = $3,
        next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
    FROM p, j WHERE photo_jobs.photo_id = $1 AND p.id = $1 AND photo_jobs.type = 'process'
      AND p.open AND j.owned
    RETURNING photo_jobs.photo_id
), photo AS (
    UPDATE photos SET processing_state = 'processing_failed', error_code = $2,
        updated_at = now(), last_activity_at = now()
    WHERE id = $1 AND EXISTS (SELECT 1 FROM job)
    RETURNING photos AS changed
), event AS (
    INSERT INTO photo_events (photo_id, type, data)
    SELECT (changed).id, 'darkroom.photo.failed', darkroom_event_data(changed, $2, $3)
    FROM photo
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
)
SELECT CASE
    WHEN EXISTS (SELECT 1 FROM job) THEN 'failed'
    WHEN NOT EXISTS (SELECT 1 FROM p WHERE open) THEN 'finished'
    WHEN EXISTS (SELECT 1 FROM j WHERE stream_entry <> $5) THEN 'finished'
    ELSE 'not_owner' END
"""

FailRecord = Literal["failed", "finished", "not_owner"]


@translated
async def record_failure(
    pool: Pool, photo_id: uuid.UUID, token: int, entry_id: str, code: str, message: str
) -> FailRecord:
    """Final failure, atomically on job and photo, by the lease holder: `failed`. Nothing
    changes otherwise: `finished` when the photo is already terminal (processed, or failed
    through another delivery), gone, or its job now goes through another entry (this entry
    is a stale duplicate); `not_owner` when another claim of this same entry holds the job
    (another process reclaimed it) or this delivery never claimed it (`token` 0)."""
    record: FailRecord = await pool.fetchval(
        FAIL_SQL, photo_id, code, message[:2000], token, entry_id
    )
    return record


# A re-render (a processed photo with a request) that failed for good, by the lease holder:
# its job records the code and message, the photo keeps its renditions and state. The
# requests up to the generation it rendered are answered (by this failure); a request made
# since is not: it stays, and `enqueued_at` is cleared so that the feeder puts the photo
# through again. So a failed re-render never stays counted as in flight.
RERENDER_FAILED_SQL = """
WITH p AS (
    -- the photo first, as every statement that writes an event (its order per photo)
    SELECT id, processing_state, rerender_requested_at, rerender_generation, photos AS photo
    FROM photos WHERE id = $1 FOR UPDATE
), job AS (
UPDATE photo_jobs j SET state = 'failed', error_code = $2, last_error = $3,
    next_retry_at = NULL, transient_since = NULL, finished_at = now(), updated_at = now()
FROM p
WHERE j.photo_id = $1 AND j.type = 'process' AND j.state = 'active' AND j.lease_token = $4
  AND p.id = $1 AND p.processing_state = 'processed' AND p.rerender_requested_at IS NOT NULL
RETURNING j.photo_id, p.rerender_generation > j.generation AS again
), photo AS (
    UPDATE photos SET
        rerender_requested_at = CASE WHEN job.again THEN rerender_requested_at END,
        enqueued_at = CASE WHEN job.again THEN NULL ELSE enqueued_at END,
        updated_at = now(), last_activity_at = now()
    FROM job WHERE photos.id = $1 AND job.photo_id = $1
), event AS (
    INSERT INTO photo_events (photo_id, type, data)
    SELECT p.id, 'darkroom.photo.rerender_failed', darkroom_event_data(p.photo, $2, $3)
    FROM p WHERE p.id IN (SELECT photo_id FROM job)
    RETURNING pg_notify('darkroom_events', darkroom_event_notice(id, photo_id, type))
)
SELECT photo_id, again FROM job
"""


RerenderFailed = Literal["answered", "again", "not_recorded"]


@translated
async def record_rerender_failure(
    pool: Pool, photo_id: uuid.UUID, token: int, code: str, message: str
) -> RerenderFailed:
    """`answered` (every request was this render's), `again` (a request made during it
    goes through once more), or `not_recorded`: no failed re-render of this lease's
    (nothing changed)."""
    row = await pool.fetchrow(RERENDER_FAILED_SQL, photo_id, code, message[:2000], token)
    if row is None:
        return "not_recorded"
    return "again" if row["again"] else "answered"
