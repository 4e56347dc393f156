"""Photo events: commit → XADD latency on a quiet queue, and the relay's throughput on a
burst, on the local PostgreSQL and Redis.

    .venv/bin/python bench/events.py [--events 300] [--burst 2000] [--out docs/benchmarks.md]

It creates its own database (dropped after) and events stream (deleted after) and runs the
relay (relay.Relay, as a worker does) in this process. Quiet: one publish at a time, 20 ms
apart; each latency runs from the publish's return (its commit acknowledged) to the entry's
XADD (the Redis clock of its id: same host) and to a reader's XREAD. Burst: that many photos
published by 8 concurrent writers; the time until the last event is on the stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import redis.asyncio as redis
from report import machine, write_section

from darkroom.queue.eventstream import EventStream
from darkroom.relay import Relay
from darkroom.store import db, leases, publishing

FACTS = {"width": 4000, "height": 3000, "format": "jpeg", "bytes": 5_000_000}
RENDITIONS = json.dumps([{"name": "thumb", "key": "renditions/x/thumb.webp", "format": "webp",
                          "width": 320, "height": 240, "bytes": 9000}])  # fmt: skip


async def admin(pg: str, sql: str) -> None:
    conn = await asyncpg.connect(f"{pg}/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def claimed(pool: db.Pool, count: int) -> list[leases.Claim]:
    claims = []
    for photo_id in [uuid.uuid4() for _ in range(count)]:
        await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
        claims.append(await leases.claim(pool, photo_id, "1-0", "bench"))
    return claims


async def publish(pool: db.Pool, claim: leases.Claim) -> None:
    """Publish under the claim's lease (its token, through entry 1-0)."""
    await publishing.publish(pool, claim.photo_id, FACTS, RENDITIONS, (claim.token, "1-0"))


async def quiet(pool: db.Pool, client: Any, key: str, count: int) -> dict[str, list[float]]:
    claims, last = await claimed(pool, count), "0-0"
    to_xadd, to_read = [], []
    for claim in claims:
        await anyio.sleep(0.02)
        await publish(pool, claim)
        committed_ms = time.time() * 1000
        reply = await client.xread({key: last}, count=1, block=5000)
        read_ms = time.time() * 1000
        last = reply[0][1][0][0]
        to_xadd.append(int(last.split("-")[0]) - committed_ms)
        to_read.append(read_ms - committed_ms)
    return {"xadd": to_xadd, "read": to_read}


async def burst(pool: db.Pool, client: Any, key: str, count: int) -> tuple[float, float]:
    """(seconds the writers took, seconds from the last commit to the last XADD)."""
    claims = await claimed(pool, count)
    before = await client.xlen(key)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for part in range(8):
            tg.start_soon(publish_all, pool, claims[part::8])
    committed = time.perf_counter()
    while await client.xlen(key) < before + count:  # noqa: ASYNC110 (a bench, polling Redis)
        await anyio.sleep(0.005)
    return committed - started, time.perf_counter() - committed


async def publish_all(pool: db.Pool, claims: list[leases.Claim]) -> None:
    for claim in claims:
        await publish(pool, claim)


def quantiles(values: list[float]) -> str:
    cuts = statistics.quantiles(values, n=100)
    return f"{cuts[49]:.1f} | {cuts[98]:.1f} | {max(values):.1f}"


def report(
    args: argparse.Namespace, lat: dict[str, list[float]], burst: tuple[float, float]
) -> str:
    return f"""## Events

`bench/events.py`, {machine()}. The relay in the benchmark's process, woken by
LISTEN/NOTIFY; {args.events} photos published one at a time, 20 ms apart (a quiet queue).
Milliseconds from the publish's commit (acknowledged to the client) to:

| to | p50 | p99 | max |
|---|---|---|---|
| the XADD (the entry id's clock) | {quantiles(lat["xadd"])} |
| a reader's `XREAD BLOCK` return | {quantiles(lat["read"])} |

A negative figure is an XADD made before the client had the commit's
reply (NOTIFY is delivered at the commit; entry ids count whole milliseconds). Target: p99
≤ 1,000 ms from the commit to the XADD. A burst: {args.burst} photos published
by 8 concurrent writers in {burst[0]:.2f} s ({args.burst / burst[0]:.0f} publishes/s, the
writers' limit here); the last event was on the stream {burst[1] * 1000:.0f} ms after the
last commit (the relay sends batches of up to 500, one pipelined round trip each).
"""


async def main(args: argparse.Namespace) -> str:
    name = f"darkroom_bench_events_{os.getpid()}"
    url = f"{args.pg}/{name}"
    client = redis.Redis.from_url(args.redis, decode_responses=True)
    key = f"{{bench{uuid.uuid4().hex[:10]}}}:events"
    await db.migrate(url)
    pool = await db.connect(url, 10)
    relay = Relay(url, EventStream(client, key, 100_000), "darkroom://bench", 7)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(relay.run)
            await anyio.sleep(1)  # the relay takes its lock
            lat = await quiet(pool, client, key, args.events)
            burst_s = await burst(pool, client, key, args.burst)
            tg.cancel_scope.cancel()
        return report(args, lat, burst_s)
    finally:
        await pool.close()
        await client.delete(key)
        await client.aclose()
        await admin(args.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, help="rewrite the events section of this file")
    arguments = parser.parse_args()
    section = asyncio.run(main(arguments))
    if arguments.out:
        write_section(arguments.out, "events", section)
        print(f"wrote the events section of {arguments.out}", file=sys.stderr)
    else:
        print(section)
