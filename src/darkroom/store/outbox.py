"""The photo events outbox in PostgreSQL (photo_events in schema.sql): its queries, the
dedicated LISTEN connection, and the CloudEvents 1.0 envelope of a row. The rows are written
by the outcome statements themselves (publishing.PUBLISH_SQL, failures.FAIL_SQL and
RERENDER_FAILED_SQL).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg

from darkroom import errors
from darkroom.store.db import ERRORS, translated
from darkroom.store.duties import Fence, fenced

CHANNEL = "darkroom_events"

Conn = Any  # an asyncpg connection (dedicated or pooled) or pool: each has fetch/execute


@dataclass(frozen=True)
class Event:
    seq: int  # photo_events.id: the order of publication
    event_id: uuid.UUID
    photo_id: uuid.UUID
    type: str
    data: dict[str, Any]
    created_at: datetime
    traceparent: str | None = None  # the photo's (schema.sql): the event joins its trace


COLUMNS = """id, event_id, photo_id, type, data::text AS data, created_at,
    (SELECT p.traceparent FROM photos p WHERE p.id = photo_events.photo_id) AS traceparent"""
# Served by photo_events_unpublished_idx: the cost is the backlog of unpublished rows.
UNPUBLISHED_SQL = f"""
SELECT {COLUMNS} FROM photo_events WHERE published_at IS NULL ORDER BY id LIMIT $1
"""
# Fenced ($2..$4, the relay's duty): whether the fence held, whatever the update did.
# Committed without waiting for the WAL flush (`quick`, as the history's writes): a mark
# that a crash of PostgreSQL loses only sends its events once more, which the relay's
# at-least-once delivery allows (consumers dedupe by id); one fsync less per relay pass.
MARK_SQL = f"""
WITH quick AS (SELECT set_config('synchronous_commit', 'off', true)),
fence AS (SELECT {fenced(2)} AS held FROM quick),
marked AS (
    UPDATE photo_events SET published_at = now()
    WHERE id = ANY($1::bigint[]) AND (SELECT held FROM fence)
)
SELECT held FROM fence
"""
# The relay's pass when it has sent events: their fenced mark ($1, the fence in $3..$5)
# and the next batch ($2) in one statement, one transaction, as MARK_SQL commits. The read
# shares the mark's snapshot, which still shows the rows it marks unpublished: they are
# left out by id. The read runs only while the fence holds; the first row says whether it
# did (a LEFT JOIN: one row with NULL columns when nothing is left to send).
MARK_AND_READ_SQL = f"""
WITH quick AS (SELECT set_config('synchronous_commit', 'off', true)),
fence AS (SELECT {fenced(3)} AS held FROM quick),
marked AS (
    UPDATE photo_events SET published_at = now()
    WHERE id = ANY($1::bigint[]) AND (SELECT held FROM fence)
),
next AS (
    SELECT {COLUMNS} FROM photo_events
    WHERE published_at IS NULL AND id <> ALL($1::bigint[]) AND (SELECT held FROM fence)
    ORDER BY id LIMIT $2
)
SELECT f.held, n.* FROM fence f LEFT JOIN next n ON true ORDER BY n.id
"""
AFTER_SQL = f"SELECT {COLUMNS} FROM photo_events WHERE id > $1 ORDER BY id LIMIT $2"
BY_IDS_SQL = f"SELECT {COLUMNS} FROM photo_events WHERE id = ANY($1::bigint[]) ORDER BY id"
SEQ_OF_SQL = "SELECT id FROM photo_events WHERE event_id = $1"
# The last row before a time (photo_events_created_idx): a replay from a time starts after it.
BEFORE_TIME_SQL = """
SELECT coalesce((SELECT id FROM photo_events WHERE created_at < $1
                 ORDER BY created_at DESC, id DESC LIMIT 1), 0)
"""
# One bounded batch of published rows past retention (photo_events_created_idx). A row not
# yet published is kept whatever its age: Redis has not seen it.
PRUNE_SQL = """
DELETE FROM photo_events WHERE id IN (
    SELECT id FROM photo_events
    WHERE created_at < now() - make_interval(secs => $1) AND published_at IS NOT NULL
    ORDER BY created_at, id LIMIT $2)
"""


def _event(row: Any) -> Event:
    return Event(row["id"], row["event_id"], row["photo_id"], row["type"],
                 json.loads(row["data"]), row["created_at"], row["traceparent"])  # fmt: skip


@translated
async def unpublished(conn: Conn, limit: int) -> list[Event]:
    return [_event(row) for row in await conn.fetch(UNPUBLISHED_SQL, limit)]


@translated
async def mark_published(conn: Conn, seqs: list[int], fence: Fence) -> bool:
    """False (nothing marked): the relay's duty was taken over, or its lease ran out."""
    return bool(await conn.fetchval(MARK_SQL, seqs, *fence.args))


@translated
async def mark_and_read(
    conn: Conn, seqs: list[int], limit: int, fence: Fence
) -> list[Event] | None:
    """Mark `seqs` published and read the next batch; None (nothing marked, nothing read):
    the relay's duty was taken over, or its lease ran out."""
    rows = await conn.fetch(MARK_AND_READ_SQL, seqs, limit, *fence.args)
    if not rows[0]["held"]:
        return None
    return [_event(row) for row in rows if row["id"] is not None]


@translated
async def after(conn: Conn, seq: int, limit: int) -> list[Event]:
    return [_event(row) for row in await conn.fetch(AFTER_SQL, seq, limit)]


@translated
async def by_seqs(conn: Conn, seqs: list[int]) -> list[Event]:
    return [_event(row) for row in await conn.fetch(BY_IDS_SQL, seqs)]


@translated
async def seq_of(conn: Conn, event_id: uuid.UUID) -> int | None:
    """The row of a CloudEvents id; None once retention deleted it (or it never was)."""
    seq: int | None = await conn.fetchval(SEQ_OF_SQL, event_id)
    return seq


@translated
async def seq_before(conn: Conn, at: datetime) -> int:
    seq: int = await conn.fetchval(BEFORE_TIME_SQL, at)
    return seq


@translated
async def prune(conn: Conn, keep_s: float, batch: int) -> int:
    """Delete one batch past retention; the number deleted."""
    status: str = await conn.execute(PRUNE_SQL, keep_s, batch)
    return int(status.rsplit(" ", 1)[-1])


@contextlib.asynccontextmanager
async def listening(
    url: str, heard: Callable[[str | None], None]
) -> AsyncIterator[asyncpg.Connection]:
    """A dedicated connection (not the pool's) that LISTENs: `heard` gets each NOTIFY's
    payload at its commit, and None when the connection is lost (a listener must then
    catch up)."""
    with errors.map_exceptions(ERRORS):
        conn = await asyncpg.connect(url, timeout=10, command_timeout=30)
        try:
            conn.add_termination_listener(lambda _conn: heard(None))
            await conn.add_listener(CHANNEL, lambda _c, _pid, _channel, payload: heard(payload))
            yield conn
        finally:
            conn.terminate()  # no goodbye: the server may be the reason we leave


@translated
async def listen(conn: Conn, on: bool) -> None:
    """Turn the server side of `listening`'s LISTEN on or off (its callback stays): an
    idle session that listens reads every NOTIFY of the database, on any channel, in a
    transaction of its own (PostgreSQL 15), so a relay that passes back to back anyway
    stops listening while it does."""
    await conn.execute(f"{'LISTEN' if on else 'UNLISTEN'} {CHANNEL}")


@translated
async def ping(conn: Conn) -> None:
    """A listener idle for long checks its connection is still there."""
    await conn.fetchval("SELECT 1")


def notice(payload: str) -> dict[str, Any]:
    """A NOTIFY payload (schema.sql darkroom_event_notice): id, photo_id, type."""
    decoded: dict[str, Any] = json.loads(payload)
    return decoded


def envelope(event: Event, source: str) -> dict[str, Any]:
    """Pure: the CloudEvents 1.0 structured form; `id` is the row's uuid, stable across
    every republication, `time` the committing transaction's clock; `traceparent` (the
    distributed-tracing extension) the photo's trace context, when it has one."""
    traced = {"traceparent": event.traceparent} if event.traceparent else {}
    return {
        "specversion": "1.0",
        "id": str(event.event_id),
        "source": source,
        "type": event.type,
        "subject": str(event.photo_id),
        "time": event.created_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "datacontenttype": "application/json",
        "data": event.data,
        **traced,
    }
