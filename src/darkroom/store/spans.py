"""Which deliveries' `darkroom.process` spans are known to have left (docs/tracing.md, "Spans
the exporter never confirmed"): `photo_attempts.span_sent`, set once the exporter reports a
batch holding the span delivered, or once a late writer wrote it from the row (or found
nothing to write). A traced worker reads the rows past a grace period that are not set, and
writes their spans from the history: a delivery that ended but whose worker was killed before
its batch left, one that waited for its ack through a Redis outage and was killed there, a
killed one whose reclaimer was killed in turn.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from darkroom import errors
from darkroom.store.db import ERRORS, Connection, Pool, translated
from darkroom.store.history import QUICK

# Spans older than this are not written late: a collector keeps traces for days, but a
# viewer's search window and a backend's ingestion (Jaeger, Tempo reject spans far in the
# past) do not reach back further, and the index's range scan stays short.
LATE_WINDOW = "1 hour"


@dataclass(frozen=True)
class Unsent:
    """A delivery whose span no exporter confirmed: its row, and the photo's context."""

    row_id: int
    photo_id: uuid.UUID
    entry_id: str
    lane: str
    span_id: str
    started_at: datetime
    # None: the delivery never ended (its worker died); `superseded_at`, the next claim's start
    ended_at: datetime | None
    superseded_at: datetime | None
    outcome: str
    error_code: str | None
    error: str | None
    traceparent: str | None
    tenant: str
    publish_ms: float | None = None


# Sent, by the exporter's report: the photo's rows (photo_attempts_photo_idx), then the id.
# Committed asynchronously, as the history's writes (history.QUICK): a crash of PostgreSQL
# itself may lose its last marks, which costs a late copy of those spans, nothing else.
SENT_SQL = f"""{QUICK}
UPDATE photo_attempts a SET span_sent = true
FROM quick, unnest($1::uuid[], $2::text[]) AS sent(photo_id, span_id)
WHERE a.photo_id = ANY($1::uuid[]) AND a.photo_id = sent.photo_id AND a.span_id = sent.span_id
  AND NOT a.span_sent
"""


@translated
async def sent(pool: Pool | Connection, pairs: list[tuple[uuid.UUID, str]]) -> None:
    """The exporter delivered these (photo, span id) spans."""
    if pairs:
        await pool.execute(SENT_SQL, [p for p, _ in pairs], [s for _, s in pairs])


# The oldest unsent rows past the grace ($1 s; photo_attempts_unsent_idx): a delivery that
# ended that long ago, or a `running` one whose job does not name it under a live lease (as
# history.COLUMNS reads `worker_died`) and whose next claim (a later row of a delivery that
# took the job, not one that found it busy or done) is that old, so the reclaim's own span
# had its time to leave. Locked, skipping what another worker's late writer holds: one
# writer per row.
UNSENT_SQL = f"""
SELECT a.id, a.photo_id, a.entry_id, coalesce(a.lane, '') AS lane, a.span_id, a.started_at,
       a.ended_at, next.started_at AS superseded_at, a.outcome, a.error_code, a.error,
       p.traceparent, coalesce(p.tenant, '') AS tenant, a.publish_ms
FROM photo_attempts a
JOIN photos p ON p.id = a.photo_id
LEFT JOIN LATERAL (
    SELECT b.started_at FROM photo_attempts b
    WHERE b.photo_id = a.photo_id AND b.started_at > a.started_at
      AND b.outcome NOT IN ('busy', 'already', 'skipped')
    ORDER BY b.started_at LIMIT 1) next ON a.ended_at IS NULL
WHERE a.span_id IS NOT NULL AND NOT a.span_sent
  AND a.started_at > now() - interval '{LATE_WINDOW}'
  AND a.started_at < now() - $1 * interval '1 second'
  AND (a.ended_at < now() - $1 * interval '1 second'
       OR (a.ended_at IS NULL AND next.started_at < now() - $1 * interval '1 second'
           AND NOT EXISTS (
               SELECT 1 FROM photo_jobs j
               WHERE j.photo_id = a.photo_id AND j.type = 'process' AND j.state = 'active'
                 AND j.stream_entry = a.entry_id AND j.consumer = a.consumer
                 AND j.lease_until > now())))
ORDER BY a.started_at LIMIT $2
FOR UPDATE OF a SKIP LOCKED
"""

SETTLED_SQL = "UPDATE photo_attempts SET span_sent = true WHERE id = ANY($1::bigint[])"


@dataclass
class Batch:
    """Rows locked for one late writer until the block ends."""

    conn: Connection
    rows: list[Unsent]

    async def settle(self, rows: Iterable[Unsent]) -> None:
        """Written and confirmed, or nothing to write: not looked at again."""
        await self.conn.execute(SETTLED_SQL, [r.row_id for r in rows])


def _unsent(row: Any) -> Unsent:
    return Unsent(row["id"], row["photo_id"], row["entry_id"], row["lane"], row["span_id"],
                  row["started_at"], row["ended_at"], row["superseded_at"], row["outcome"],
                  row["error_code"], row["error"], row["traceparent"], row["tenant"],
                  row["publish_ms"])  # fmt: skip


@contextlib.asynccontextmanager
async def unsent(pool: Pool, grace_s: float, limit: int) -> AsyncIterator[Batch]:
    """At most `limit` rows past the grace whose spans no exporter confirmed, locked (other
    writers skip them) until the block ends; settled rows commit with it."""
    with errors.map_exceptions(ERRORS):
        async with pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(UNSENT_SQL, grace_s, limit)
            yield Batch(conn, [_unsent(r) for r in rows])
