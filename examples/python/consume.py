"""A consumer of darkroom's events (redis-py + asyncpg): read `{darkroom}:events` through a
consumer group, handle each CloudEvent once (dedupe on its `id`), then XACK.

    python consume.py                 # until Ctrl-C
    python consume.py --idle-exit 3   # stop after 3 s without an event (what the tests do)

An event is delivered at least once (a redelivery after a crash, the relay's retry), so the
handler records the event's `id` in the same transaction as its own effect: a duplicate
finds the id already there and is only acked. Prints `<type> <photo_id> <id>` per event.
"""

import asyncio
import json
import os
import sys

import asyncpg
import redis.asyncio as redis
from redis.exceptions import ResponseError

DATABASE_URL = os.environ.get("DARKROOM_DATABASE_URL", "postgresql://postgres@127.0.0.1/darkroom")
REDIS_URL = os.environ.get("DARKROOM_REDIS_URL", "redis://127.0.0.1:6379/0")
EVENTS = os.environ.get("DARKROOM_EVENTS_STREAM", "{darkroom}:events")
GROUP, CONSUMER = "example-gallery", f"gallery-{os.getpid()}"
SEEN = "CREATE TABLE IF NOT EXISTS example_seen_events (id text PRIMARY KEY)"


async def handle(db: asyncpg.Connection, fields: dict[str, str]) -> None:
    event = json.loads(fields["event"])
    async with db.transaction():  # the dedupe row commits with the handler's own effect
        new = await db.fetchval(
            "INSERT INTO example_seen_events (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING 1",
            event["id"],
        )
        if new:  # the effect: here a line; a gallery would update its own tables
            print(event["type"], event["data"].get("photo_id"), event["id"], flush=True)


async def consume(idle_exit_s: float | None) -> None:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    db = await asyncpg.connect(DATABASE_URL)
    await db.execute(SEEN)
    try:
        await r.xgroup_create(EVENTS, GROUP, id="0", mkstream=True)
    except ResponseError as exc:  # BUSYGROUP: the group exists
        if "BUSYGROUP" not in str(exc):
            raise
    start, idle_s = "0", 0.0  # first this consumer's own pending entries, then new ones
    while idle_exit_s is None or idle_s < idle_exit_s:
        reply = await r.xreadgroup(GROUP, CONSUMER, {EVENTS: start}, count=50, block=1000)
        entries = reply[0][1] if reply else []
        for entry_id, fields in entries:
            await handle(db, fields)
            await r.xack(EVENTS, GROUP, entry_id)  # after the commit: a crash redelivers
        idle_s = 0.0 if entries or start == "0" else idle_s + 1.0  # a `>` read blocks 1 s
        start = ">" if start == "0" and not entries else start
    await r.aclose()
    await db.close()


if __name__ == "__main__":
    idle = float(sys.argv[sys.argv.index("--idle-exit") + 1]) if "--idle-exit" in sys.argv else None
    asyncio.run(consume(idle))
