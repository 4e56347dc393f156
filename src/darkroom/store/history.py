"""The attempt history in PostgreSQL (`photo_attempts`): a row per delivery that reached a
worker, its stage timings and outcome; the timeline of a photo, the search behind
`darkroom attempts`, and the retention's batched deletes. One function per query; the
history never fails a photo (jobs.py logs a failed write and goes on).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from darkroom.store.db import Connection, Pool, translated
from darkroom.store.publishing import FACT_COLUMNS

STAGES = ("download", "render", "upload", "publish")
ERROR_MAX_CHARS = 1000


@dataclass
class Attempt:
    """One delivery as the worker lives it: its row (None until inserted), the time spent
    in each stage (summed over retries in place) and the render's peak RSS."""

    row_id: int | None = None
    stages_ms: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    finished: bool = False  # its row was finished already (by the publishing commit)

    def add(self, stage: str, ms: float) -> None:
        self.stages_ms[stage] = self.stages_ms.get(stage, 0.0) + ms


@dataclass(frozen=True)
class Ending:
    outcome: str
    error_code: str | None = None
    error: str | None = None


# Every write here commits asynchronously (`quick`: synchronous_commit off for its own
# transaction): it returns without waiting for the WAL flush, about 10 ms less per statement
# on this project's disks (docs/history.md). A worker's crash loses nothing by it; a crash
# of PostgreSQL itself may lose the history writes of its last ~0.6 s (3 × wal_writer_delay),
# never a photo's state, whose statements keep synchronous commits.
QUICK = "WITH quick AS (SELECT set_config('synchronous_commit', 'off', true))"

# `lane`: the lane of the stream the entry came through (Entry.lane), which is what the
# delivery lived; the photo's row may name another lane by now (`enqueue --lane`).
START_SQL = f"""{QUICK}
INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane)
SELECT $1, $2, $3, $4 FROM quick
RETURNING id
"""


@translated
async def start(pool: Pool, photo_id: uuid.UUID, entry_id: str, consumer: str, lane: str) -> int:
    """The row of a delivery that just claimed its job, `running` until `finish`."""
    row_id: int = await pool.fetchval(START_SQL, photo_id, entry_id, consumer, lane)
    return row_id


# Only a `running` row: one the publishing commit finished stays `published`, even when its
# worker never heard back (the reply was lost, the retry in place then found it `already`).
FINISH_SQL = f"""{QUICK}
UPDATE photo_attempts SET ended_at = now(), outcome = $2, error_code = $3, error = $4,
    download_ms = $5, render_ms = $6, upload_ms = $7, publish_ms = $8, peak_rss_mb = $9
FROM quick WHERE id = $1 AND outcome = 'running'
"""


@translated
async def finish(pool: Pool, attempt: Attempt, ending: Ending) -> None:
    await pool.execute(FINISH_SQL, attempt.row_id, *_ending_args(attempt, ending))


# `span_id` ($13): the delivery's span (tracing on), for a late writer (store/spans.py).
RECORD_SQL = f"""{QUICK}
INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane, ended_at, outcome,
    error_code, error, download_ms, render_ms, upload_ms, publish_ms, peak_rss_mb, span_id,
    span_sent)
SELECT $1, $2, $3, $4, now(), $5, $6, $7, $8, $9, $10, $11, $12, $13, $13::text IS NULL
FROM quick
"""


@translated
async def record(
    pool: Pool,
    photo_id: uuid.UUID | None,
    entry_id: str,
    consumer: str,
    lane: str,
    attempt: Attempt,
    ending: Ending,
    span_id: str | None = None,
) -> None:
    """A delivery that ended without a `running` row (it claimed nothing, or the insert
    failed): one finished row."""
    args = (photo_id, entry_id, consumer, lane, *_ending_args(attempt, ending), span_id)
    await pool.execute(RECORD_SQL, *args)


def _ending_args(attempt: Attempt, ending: Ending) -> tuple[Any, ...]:
    error = ending.error[:ERROR_MAX_CHARS] if ending.error is not None else None
    stages = (attempt.stages_ms.get(stage) for stage in STAGES)
    return (ending.outcome, ending.error_code, error, *stages, attempt.peak_rss_mb)


# A `running` row whose job no longer names this delivery under a live lease was cut
# short by its worker's death (SIGKILL, OOM, power): shown as `worker_died`.
COLUMNS = """
a.id, a.photo_id, a.entry_id, a.consumer, a.lane, a.started_at, a.ended_at,
a.download_ms, a.render_ms, a.upload_ms, a.publish_ms, a.error_code, a.error, a.peak_rss_mb,
CASE WHEN a.outcome = 'running' AND NOT EXISTS (
         SELECT 1 FROM photo_jobs j
         WHERE j.photo_id = a.photo_id AND j.type = 'process' AND j.state = 'active'
           AND j.stream_entry = a.entry_id AND j.consumer = a.consumer
           AND j.lease_until > now())
     THEN 'worker_died' ELSE a.outcome END AS outcome
"""

TIMELINE_SQL = f"""
SELECT {COLUMNS} FROM photo_attempts a WHERE a.photo_id = $1
ORDER BY a.started_at, a.id LIMIT $2
"""


@translated
async def timeline(pool: Pool, photo_id: uuid.UUID, limit: int = 200) -> list[dict[str, Any]]:
    """The photo's deliveries, oldest first (photo_attempts_photo_idx)."""
    return [dict(r) for r in await pool.fetch(TIMELINE_SQL, photo_id, limit)]


# Newest first; each filter is optional (NULL). The code and consumer filters have their
# own (column, started_at) index; no filter reads photo_attempts_started_idx backwards.
SEARCH_SQL = f"""
SELECT {COLUMNS} FROM photo_attempts a
WHERE ($1::text IS NULL OR a.error_code = $1) AND ($2::timestamptz IS NULL OR a.started_at >= $2)
  AND ($3::text IS NULL OR a.consumer = $3)
ORDER BY a.started_at DESC, a.id DESC LIMIT $4
"""


@translated
async def search(
    pool: Pool, code: str | None, since: datetime | None, consumer: str | None, limit: int
) -> list[dict[str, Any]]:
    return [dict(r) for r in await pool.fetch(SEARCH_SQL, code, since, consumer, limit)]


# One batch of the oldest expired rows; each batch is its own short transaction and
# touches only rows no worker writes any more (a delivery's row is written at its start
# and its end, never days later).
PRUNE_SQL = f"""{QUICK}
DELETE FROM photo_attempts USING quick WHERE id IN (
    SELECT id FROM photo_attempts
    WHERE started_at < now() - $1 * interval '1 day'
    ORDER BY started_at LIMIT $2)
"""


@translated
async def prune_batch(pool: Pool | Connection, keep_days: float, batch: int) -> int:
    """Delete at most `batch` rows older than `keep_days`; how many were deleted."""
    status: str = await pool.execute(PRUNE_SQL, keep_days, batch)
    return int(status.split()[-1])


FACTS_SQL = "SELECT {columns} FROM photos WHERE id = $1".format(columns=", ".join(FACT_COLUMNS))


@translated
async def facts(pool: Pool, photo_id: uuid.UUID) -> dict[str, Any] | None:
    """The facts read from the original at its render (publishing.FACT_COLUMNS), None: no photo."""
    row = await pool.fetchrow(FACTS_SQL, photo_id)
    if row is None:
        return None
    exposure = row["exposure"]  # jsonb arrives as its text
    return {**row, "exposure": json.loads(exposure) if exposure else None}
