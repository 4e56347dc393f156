"""One sweep pass over a big backlog: 300,000 stale unfinished photos whose stream entries
all exist, on the local PostgreSQL and Redis.

    .venv/bin/python bench/sweep.py [--photos 300000] [--out docs/benchmarks.md]

It creates its own database (dropped after) and a uniquely named stream (deleted after),
bulk-loads photos and jobs with COPY, runs `sweeper.sweep` once and reports the pass time,
pages, rows scanned, photos re-enqueued (must be 0), the time of each page's query and
Redis check, and the page query of the old shape (a sort over a computed `greatest(...)`)
for comparison. `--out` rewrites only the `## Sweep` section of the report, between its
markers, so the render benchmark's part of the file survives.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import redis.asyncio as redis

from darkroom import metrics, sweeper
from darkroom.queue.streams import Streams
from darkroom.store import db

BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"
AFTER_S = 300.0
CHUNK = 10_000

# The page query before the sweep's keyset on photos.last_activity_at: keyset over a
# computed expression no index serves.
OLD_STALE_SQL = """
SELECT * FROM (
    SELECT p.id, j.stream_entry,
           (extract(epoch FROM greatest(p.updated_at, coalesce(j.updated_at, p.updated_at)))
            * 1000)::bigint AS last_activity_ms
    FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
    WHERE p.processing_state IN ('uploaded', 'processing')
) stale
WHERE last_activity_ms < (extract(epoch FROM now() - make_interval(secs => $1)) * 1000)::bigint
  AND (last_activity_ms, id) > ($3, $4)
ORDER BY last_activity_ms, id
LIMIT $2
"""


async def admin(pg: str, sql: str) -> None:
    conn = await asyncpg.connect(f"{pg}/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def xadd_all(client: redis.Redis, stream: str, ids: list[uuid.UUID]) -> list[str]:
    entries: list[str] = []
    for start in range(0, len(ids), CHUNK):
        async with client.pipeline(transaction=False) as pipe:
            for photo_id in ids[start : start + CHUNK]:
                pipe.xadd(stream, {"photo_id": str(photo_id)})
            entries += [str(e) for e in await pipe.execute()]
    return entries


async def load(pool: db.Pool, ids: list[uuid.UUID], entries: list[str]) -> None:
    """Photos an hour old, ten at a time sharing one timestamp (keyset ties), each with a
    job delivered through an entry that is still in the stream."""
    base = datetime.now(UTC) - timedelta(hours=1)
    stamps = [base - timedelta(milliseconds=(len(ids) - i) // 10) for i in range(len(ids))]
    states = ("uploaded", "processing")
    photos = [
        (pid, f"originals/{pid}", states[i % 2], t, t, t)
        for i, (pid, t) in enumerate(zip(ids, stamps, strict=True))
    ]
    jobs = [
        (pid, "process", "pending", 1, entry, t)
        for pid, entry, t in zip(ids, entries, stamps, strict=True)
    ]
    async with pool.acquire() as conn:
        await conn.copy_records_to_table(
            "photos",
            records=photos,
            columns=["id", "original_key", "processing_state", "created_at", "updated_at",
                     "last_activity_at"],
        )  # fmt: skip
        await conn.copy_records_to_table(
            "photo_jobs",
            records=jobs,
            columns=["photo_id", "type", "state", "attempt", "stream_entry", "updated_at"],
        )
        await conn.execute("ANALYZE photos; ANALYZE photo_jobs")


def timed(log: list[float], fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            log.append(time.perf_counter() - started)

    return wrapper


async def one_pass(pool: db.Pool, streams: Streams) -> dict[str, Any]:
    pages: list[float] = []
    checks: list[float] = []
    original = db.stale_photos
    db.stale_photos = timed(pages, original)  # type: ignore[assignment]
    streams.missing = timed(checks, streams.missing)  # type: ignore[method-assign]
    scanned_before = metrics.SWEEP_SCANNED._value.get()
    started = time.perf_counter()
    try:
        requeued = await sweeper.sweep(pool, streams, AFTER_S)
    finally:
        db.stale_photos = original  # type: ignore[assignment]
    return {
        "pass_s": time.perf_counter() - started,
        "load": os.getloadavg()[0],
        "pages": len(pages) - 1,  # the last query finds the empty page
        "scanned": int(metrics.SWEEP_SCANNED._value.get() - scanned_before),
        "requeued": len(requeued),
        "page_ms": [p * 1000 for p in pages],
        "check_ms": [c * 1000 for c in checks],
    }


async def old_shape(pool: db.Pool, rounds: int = 3) -> dict[str, float]:
    """The old page query, first page and a page from the middle of the backlog."""
    async with pool.acquire() as conn:
        middle = await conn.fetchrow(
            "SELECT id, (extract(epoch FROM last_activity_at) * 1000)::bigint AS ms FROM photos"
            " ORDER BY last_activity_at, id OFFSET (SELECT count(*) / 2 FROM photos) LIMIT 1"
        )
        figures = {}
        for name, after in (
            ("first", (-1, uuid.UUID(int=0))),
            ("middle", (middle["ms"], middle["id"])),
        ):
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                await conn.fetch(OLD_STALE_SQL, AFTER_S, sweeper.BATCH, *after)
                times.append((time.perf_counter() - started) * 1000)
            figures[name] = statistics.median(times)
    return figures


async def old_check(streams: Streams, pool: db.Pool, rounds: int = 5) -> float:
    """The old Redis check of one page: one XRANGE per entry in a pipeline (median ms)."""
    entries = [
        row["stream_entry"]
        for row in await pool.fetch("SELECT stream_entry FROM photo_jobs LIMIT $1", sweeper.BATCH)
    ]
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        async with streams.client.pipeline(transaction=False) as pipe:
            for entry_id in entries:
                pipe.xrange(streams.stream, entry_id, entry_id, count=1)
            await pipe.execute()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def plan(pool: db.Pool) -> str:
    """EXPLAIN ANALYZE of a page from the middle of the backlog."""
    async with pool.acquire() as conn:
        before = await db.sweep_horizon(conn, AFTER_S)
        middle = await conn.fetchrow(
            "SELECT last_activity_at, id FROM photos ORDER BY last_activity_at, id"
            " OFFSET (SELECT count(*) / 2 FROM photos) LIMIT 1"
        )
        rows = await conn.fetch(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) " + db.STALE_SQL,
            before, sweeper.BATCH, *middle,
        )  # fmt: skip
    return "\n".join(r[0] for r in rows)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(n: int, load_s: float, run: dict[str, Any], old: dict[str, float], text: str) -> str:
    pages, checks = run["page_ms"], run["check_ms"]
    old_pass_s = (old["middle"] + old["check"]) * run["pages"] / 1000
    lines = [
        BEGIN,
        "## Sweep",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d}",
        f"- machine: {os.cpu_count()} CPUs, {platform.system()}; PostgreSQL and Redis on"
        " localhost, shared with other work",
        f"- backlog: {n:,} unfinished photos (half `uploaded`, half `processing`), all stale"
        f" (an hour old, `SWEEP_AFTER_S` {AFTER_S:.0f}), ten at a time sharing a timestamp;"
        " each has a job whose stream entry is still in a real Redis stream; bulk-loaded"
        f" with COPY and ANALYZEd in {load_s:.1f} s",
        f"- one `sweeper.sweep` pass, pages of {sweeper.BATCH}",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| pass time | **{run['pass_s']:.2f} s** (target ≤ 15 s) |",
        f"| machine load average (1 min) right after the pass | {run['load']:.1f} |",
        f"| pages | {run['pages']:,} |",
        f"| photos scanned (`darkroom_sweep_scanned_total`) | {run['scanned']:,} |",
        f"| photos re-enqueued (must be 0) | {run['requeued']} |",
        f"| page query, median / p95 / max (ms) | {statistics.median(pages):.2f} /"
        f" {pct(pages, 0.95):.2f} / {max(pages):.2f} |",
        f"| Redis check of a page (`streams.missing`), median / p95 (ms) |"
        f" {statistics.median(checks):.2f} / {pct(checks, 0.95):.2f} |",
        f"| old page query (sort over `greatest(...)`), first / middle page (ms) |"
        f" {old['first']:.1f} / {old['middle']:.1f} |",
        f"| old Redis check of a page (one XRANGE per entry, pipelined), median (ms) |"
        f" {old['check']:.2f} |",
        f"| old shape, whole pass (pages × (middle page + old check)) | ≈ {old_pass_s:.0f} s |",
        "",
        "The page query of a page from the middle of the backlog (`EXPLAIN ANALYZE`):",
        "",
        "```",
        text,
        "```",
        "",
        "Made by `bench/sweep.py`; see bench/README.md.",
        END,
    ]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def main(args: argparse.Namespace) -> str:
    name = f"darkroom_bench_sweep_{os.getpid()}"
    client = redis.Redis.from_url(args.redis, decode_responses=True)
    tag = uuid.uuid4().hex[:10]
    streams = Streams(client, f"{{bench{tag}}}:photos", "darkroom", "bench", f"{{bench{tag}}}:dead")
    await db.migrate(f"{args.pg}/{name}")
    pool = await db.connect(f"{args.pg}/{name}", 4)
    try:
        ids = [uuid.uuid4() for _ in range(args.photos)]
        started = time.perf_counter()
        await load(pool, ids, await xadd_all(client, streams.stream, ids))
        load_s = time.perf_counter() - started
        run = await one_pass(pool, streams)
        print({k: v for k, v in run.items() if not k.endswith("_ms")}, file=sys.stderr)
        old = await old_shape(pool) if not args.skip_old else {"first": 0.0, "middle": 0.0}
        old["check"] = await old_check(streams, pool)
        return report(args.photos, load_s, run, old, await plan(pool))
    finally:
        await pool.close()
        await client.delete(streams.stream, streams.dead_stream)
        await client.aclose()
        await admin(args.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=300_000)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--skip-old", action="store_true", help="do not time the old query")
    parser.add_argument("--out", type=Path, help="rewrite the `## Sweep` section of this file")
    arguments = parser.parse_args()
    section = asyncio.run(main(arguments))
    if arguments.out:
        write_section(arguments.out, section)
        print(f"wrote the sweep section of {arguments.out}", file=sys.stderr)
    else:
        print(section)
