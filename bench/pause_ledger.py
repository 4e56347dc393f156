"""bench/pause.py's ledger: whether every photo ended published exactly once (one
`published` attempt, one claim, `attempt` 1 on its job, one `published` event, exactly the
objects its row references in the storage folder) and nothing was left pending or dead,
and the queue events the run wrote."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from darkroom.store import db
from darkroom.store.keys import keys_of

DRAIN_S = 240.0
CLAIMS = "('running', 'worker_died', 'published', 'retrying', 'failed', 'released')"

LEDGER_SQL = f"""
SELECT p.id, p.processing_state AS state, p.renditions::text AS renditions,
       (SELECT count(*) FROM photo_attempts a WHERE a.photo_id = p.id
        AND a.outcome = 'published') AS published,
       (SELECT count(*) FROM photo_attempts a WHERE a.photo_id = p.id
        AND a.outcome IN {CLAIMS}) AS claims,
       (SELECT attempt FROM photo_jobs j WHERE j.photo_id = p.id AND j.type = 'process')
       AS attempts,
       (SELECT count(*) FROM photo_events e WHERE e.photo_id = p.id
        AND e.type = 'darkroom.photo.published') AS events
FROM photos p
"""
# Queue events by type, a timed pause's apart (its `paused` names an `until`; its
# `resumed`, written by whichever replica ended it, says `expired`).
QUEUE_EVENTS_SQL = """
SELECT type || CASE WHEN data->>'until' IS NOT NULL AND type LIKE '%.paused' THEN ' (timed)'
                    WHEN (data->>'expired')::boolean THEN ' (expired)' ELSE '' END AS type,
       count(*) AS n
FROM photo_events WHERE type LIKE 'darkroom.queue.%' GROUP BY 1
"""
UNFINISHED_SQL = "SELECT count(*) FROM photos WHERE processing_state <> 'processed'"


async def drain(pool: db.Pool) -> float:
    """Wait until every photo is processed (or DRAIN_S with no progress); seconds taken."""
    started, last, moved = time.monotonic(), -1, time.monotonic()
    while (left := await pool.fetchval(UNFINISHED_SQL)) and time.monotonic() - moved < DRAIN_S:
        if left != last:
            last, moved = left, time.monotonic()
        await asyncio.sleep(1.0)
    return time.monotonic() - started


def objects(storage: Path) -> dict[str, set[str]]:
    """The rendition objects in the storage folder, by photo."""
    found: dict[str, set[str]] = {}
    for path in (storage / "renditions").glob("*/*"):
        found.setdefault(path.parent.name, set()).add(f"renditions/{path.parent.name}/{path.name}")
    return found


async def ledger(pool: db.Pool, client: aioredis.Redis, storage: Path, tag: str) -> dict[str, Any]:
    """The verdict: each photo published exactly once, nothing else left."""
    rows = await pool.fetch(LEDGER_SQL)
    stored = objects(storage)
    odd = [r for r in rows if not _once(r, stored.get(str(r["id"]), set()))]
    streams = [f"{{{tag}}}:photos", f"{{{tag}}}:photos:bulk"]
    pending = [(await client.xpending(s, "darkroom"))["pending"] for s in streams]
    events = await pool.fetch(QUEUE_EVENTS_SQL)
    return {
        "photos": len(rows), "odd": odd[:10], "odd_n": len(odd),
        "stuck": sum(r["state"] != "processed" for r in rows),
        "twice": sum(r["published"] > 1 or r["events"] > 1 for r in rows),
        "extra_claims": sum(r["claims"] - 1 for r in rows if r["claims"] > 1),
        "pending": sum(pending), "dead": await client.xlen(f"{{{tag}}}:dead"),
        "queue_events": {r["type"]: r["n"] for r in events},
    }  # fmt: skip


def _once(row: Any, stored: set[str]) -> bool:
    referenced = set(keys_of(row["renditions"]))
    return (row["state"] == "processed" and row["published"] == 1 and row["claims"] == 1
            and row["attempts"] == 1 and row["events"] == 1
            and bool(referenced) and stored == referenced)  # fmt: skip
