"""What the operator's page costs under many viewers: 300,000 photos, 100,000 dead letters,
50 viewers at once, on the local PostgreSQL and Redis.

    .venv/bin/python bench/pages.py [--viewers 50] [--seconds 20] [--out docs/benchmarks.md]

It creates its own database (dropped after) and uniquely named streams (deleted after),
fills the photos with one INSERT ... SELECT generate_series and the dead letters with
pipelined XADDs, starts `darkroom web` as a subprocess, and for each of three pages (the
overview, `/photos` filtered by a rare error code, `/dead-letters` filtered by the same
code) runs the viewers (httpx, asyncio) for a fixed time. It reports requests, p50/p95
latency, the CPU seconds of the database backends serving the page (utime + stime from
/proc/<pid>/stat of the sessions on the bench database; parallel query is turned off for
that database so that no work hides in short-lived parallel workers) and of the web
process, and what one request of the old shape cost (a count per view, the code filter
without its index, a dead-letter walk of the whole stream). `--out` rewrites only the
`pages` section of the report.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import redis.asyncio as redis
from report import machine, write_section

from darkroom.operate import ops
from darkroom.operate.web.pages import LETTER_SCAN_MAX
from darkroom.queue.streams import Streams
from darkroom.store import db, views

CODE = "image_too_large"  # the rare code every filtered viewer asks for
TICKS = os.sysconf("SC_CLK_TCK")

# 85 % processed (over the last two days), 10 % failed (one in a hundred of them with the
# rare code), 3 % uploaded, 2 % processing.
FILL_SQL = """
INSERT INTO photos (id, original_key, processing_state, visibility, error_code, width, height,
                    format, bytes, renditions, updated_at, processed_at, last_activity_at)
SELECT id, 'originals/' || id || '/p.jpg', state,
       CASE WHEN state = 'processed' THEN 'published' ELSE 'unpublished' END,
       CASE WHEN state = 'processing_failed'
            THEN CASE WHEN i % 1000 = 0 THEN $2 ELSE (ARRAY['timeout', 'corrupt_image',
                 'unsupported_format', 'original_missing'])[1 + i % 4] END END,
       CASE WHEN state = 'processed' THEN 4000 END, CASE WHEN state = 'processed' THEN 3000 END,
       CASE WHEN state = 'processed' THEN 'jpeg' END, CASE WHEN state = 'processed' THEN 2e6 END,
       CASE WHEN state = 'processed' THEN '[]'::jsonb END,
       at, CASE WHEN state = 'processed' THEN at END, at
FROM (
    SELECT gen_random_uuid() AS id, i, now() - (i * interval '576 milliseconds') AS at,
           CASE WHEN i % 100 < 10 THEN 'processing_failed' WHEN i % 100 < 13 THEN 'uploaded'
                WHEN i % 100 < 15 THEN 'processing' ELSE 'processed' END AS state
    FROM generate_series(1, $1) AS i
) rows
"""

# Every photo has its job row, as the worker leaves it (the page joins it for attempts).
JOBS_SQL = """
INSERT INTO photo_jobs (photo_id, type, state, attempt, stream_entry, updated_at)
SELECT id, 'process',
       CASE processing_state WHEN 'processed' THEN 'done' WHEN 'processing_failed' THEN 'failed'
            WHEN 'processing' THEN 'active' ELSE 'pending' END,
       1, '1-0', updated_at
FROM photos
"""

PAGES = [
    ("overview", "/"),
    (f"photos, code {CODE}", f"/photos?state=processing_failed&code={CODE}"),
    (f"dead letters, code {CODE}", f"/dead-letters?code={CODE}"),
]

# The photo page's query before the code filter had its index, timed directly for comparison.
OLD_PAGE_SQL = """
SELECT p.id, p.processing_state, p.format, p.width, p.height, p.bytes, p.error_code,
       p.renditions::text AS renditions, coalesce(j.attempt, 0) AS attempt, p.updated_at
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE ($1::text IS NULL OR p.processing_state = $1)
  AND ($2::text IS NULL OR p.error_code = $2)
  AND ($4::timestamptz IS NULL OR (p.updated_at, p.id) < ($4, $5))
ORDER BY p.updated_at DESC, p.id DESC
LIMIT $3
"""


async def fill(url: str, photos: int) -> float:
    started = time.perf_counter()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(FILL_SQL, photos, CODE)
        await conn.execute(JOBS_SQL)
        await conn.execute("ANALYZE photos; ANALYZE photo_jobs")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def add_letters(client: redis.Redis, stream: str, count: int) -> float:
    """Dead letters as the worker writes them; one in two hundred has the rare code."""
    started = time.perf_counter()
    for start in range(0, count, 10_000):
        async with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(count, start + 10_000)):
                pipe.xadd(stream, letter(i))
            await pipe.execute()
    return time.perf_counter() - started


def letter(i: int) -> dict[str, str]:
    code = CODE if i % 200 == 0 else ("timeout", "corrupt_image", "original_missing")[i % 3]
    return {
        "photo_id": str(uuid.uuid4()), "error_code": code, "attempts": "5", "stage": "render",
        "failed_at": "2026-01-01T00:00:00Z", "consumer": "bench",
        "error": f"{code}: the render of this photo failed in the bench ({i}) " + "x" * 120,
    }  # fmt: skip


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


async def backends(conn: asyncpg.Connection, name: str) -> list[int]:
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", name
    )
    return [row["pid"] for row in rows]


def start_web(env: dict[str, str], cwd: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "darkroom", "web"], env=env, cwd=cwd,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{env['DARKROOM_WEB_PORT']}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/livez", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"darkroom web did not start: {proc.communicate()[1].decode()[-2000:]}")


async def view(base: str, path: str, viewers: int, seconds: float) -> dict[str, Any]:
    """`viewers` clients requesting `path` back to back for `seconds`."""
    latencies: list[float] = []
    errors: list[int | str] = []
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=viewers, max_keepalive_connections=viewers)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def viewer() -> None:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    status = (await client.get(path)).status_code
                except httpx.TransportError as exc:  # counted, and the viewer goes on
                    status = type(exc).__name__
                if status == 200:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors.append(status)

        await asyncio.gather(*(viewer() for _ in range(viewers)))
    return {"latencies": latencies, "errors": errors}


async def phase(
    base: str, path: str, args: argparse.Namespace, conn: asyncpg.Connection, name: str,
    web_pid: int,
) -> dict[str, Any]:  # fmt: skip
    before = {pid: cpu_s(pid) for pid in await backends(conn, name)}
    web_before = cpu_s(web_pid)
    started = time.perf_counter()
    result = await view(base, path, args.viewers, args.seconds)
    elapsed = time.perf_counter() - started
    after = {pid: cpu_s(pid) for pid in await backends(conn, name)}
    result["pg_cpu_s"] = sum(t - before.get(pid, 0.0) for pid, t in after.items())
    result["web_cpu_s"] = cpu_s(web_pid) - web_before
    result["elapsed_s"] = elapsed
    result["load"] = os.getloadavg()[0]
    return result


async def timed_ms(fn: Any, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def old_shapes(url: str, streams: Streams) -> dict[str, float]:
    """One request of each page as it was: counts per view, the code filter with no index
    on error_code (the generic OR-shaped query), and the dead-letter walk of the stream."""
    pool = await db.connect(url, 1)
    try:
        counts = await timed_ms(lambda: pool.fetch(
            "SELECT processing_state, count(*) FROM photos GROUP BY 1;"))  # fmt: skip
        failures = await timed_ms(lambda: pool.fetch(
            "SELECT error_code, count(*) FROM photos WHERE processing_state ="
            " 'processing_failed' GROUP BY 1"))  # fmt: skip
        throughput = await timed_ms(lambda: both_throughputs(pool))
        new_page = await timed_ms(lambda: views.page_photos(pool, "processing_failed", CODE, 51))
        await pool.execute("DROP INDEX photos_code_idx")
        old_page = await timed_ms(
            lambda: pool.fetch(OLD_PAGE_SQL, "processing_failed", CODE, 51, None, uuid.UUID(int=0))
        )
    finally:
        await pool.close()
    walk = await timed_ms(lambda: walk_letters(streams), rounds=1)
    return {"counts": counts + failures, "throughput": throughput, "old_page": old_page,
            "new_page": new_page, "walk": walk}  # fmt: skip


async def both_throughputs(pool: db.Pool) -> None:
    await views.throughput(pool, "minute", 3600)
    await views.throughput(pool, "hour", 86400)


async def walk_letters(streams: Streams) -> int:
    return len([e async for e in ops.dead_letters(streams, [CODE], 500)])


async def plan(url: str) -> str:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SET plan_cache_mode = force_custom_plan")
        rows = await conn.fetch(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) "
            + views.page_photos_sql("processing_failed", True),
            51, *views.NEWEST, CODE,
        )  # fmt: skip
    finally:
        await conn.close()
    return "\n".join(r[0] for r in rows)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def error_text(errors: list[int | str]) -> str:
    kinds = {kind: errors.count(kind) for kind in sorted(set(errors), key=str)}
    return ", ".join(f"{n} × {kind}" for kind, n in kinds.items()) or "0"


def row(label: str, r: dict[str, Any]) -> str:
    lat, n = r["latencies"], len(r["latencies"])
    per_request_ms = 1000 * r["pg_cpu_s"] / n if n else float("nan")
    return (
        f"| {label} | {n:,} ({n / r['elapsed_s']:.0f}/s) | {1000 * pct(lat, 0.5):.0f} |"
        f" {1000 * pct(lat, 0.95):.0f} | {error_text(r['errors'])} | {r['pg_cpu_s']:.2f} s"
        f" ({per_request_ms:.2f} ms/request) | {r['web_cpu_s']:.1f} s | {r['load']:.1f} |"
    )


def report(args: argparse.Namespace, setup: dict[str, Any], runs: dict[str, Any],
           old: dict[str, float], snapshots: str, explained: str) -> str:  # fmt: skip
    """`setup["machine"]` was read before the fill, so its load average is the start's."""
    overview = runs["overview"]
    lines = [
        "## Page costs (bench/pages.py)",
        "",
        f"- {setup['machine']}",
        f"- {args.photos:,} photos (85 % processed over two days, 10 % failed, 0.1 % of"
        f" those with `{CODE}`, each with its job row; INSERT ... SELECT generate_series,"
        f" {setup['fill_s']:.1f} s) and {args.letters:,} dead letters (0.5 % `{CODE}`;"
        " pipelined XADDs,"
        f" {setup['letters_s']:.1f} s); `darkroom web` in a subprocess with the defaults"
        " (`DARKROOM_WEB_SNAPSHOT_S` 2, a pool of 4 connections); PostgreSQL and Redis on"
        " localhost, shared with other work",
        f"- {args.viewers} viewers (httpx, asyncio, in the bench process on the same 2 cores)"
        f" request one page back to back for {args.seconds:.0f} s, one page after the other",
        "- database CPU: utime + stime (from /proc/<pid>/stat) of the sessions on the bench"
        " database over the run; parallel query is off for that database, so no work hides"
        " in short-lived parallel workers. web CPU: the `darkroom web` process",
        "",
        "| page | requests served | p50 ms | p95 ms | errors | database CPU | web CPU |"
        " load (1 min) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(row(label, runs[label]) for label, _ in PAGES),
        "",
        f"Overview snapshots taken (`darkroom_web_snapshots_total`) for"
        f" {len(overview['latencies']):,} overview views: **{snapshots}**.",
        "",
        "What one request of each page cost before (the same data, timed directly, median of 3):",
        "",
        "| page | before: per request | now |",
        "|---|---:|---:|",
        f"| overview | two counts over every photo {old['counts']:.0f} ms + throughput"
        f" {old['throughput']:.0f} ms, per view and per scrape | the same once per snapshot"
        " (at most every 2 s), shared |",
        f"| photos, code `{CODE}` | {old['old_page']:.1f} ms (no index on `error_code`) |"
        f" {old['new_page']:.2f} ms (`photos_code_idx`) |",
        f"| dead letters, code `{CODE}` | a walk of all {args.letters:,} letters:"
        f" {old['walk']:.0f} ms | one XRANGE of at most {LETTER_SCAN_MAX:,} letters, labelled"
        " partial |",
        "",
        "The filtered photo page (`EXPLAIN ANALYZE`, the custom plan `views.page_photos` runs):",
        "",
        "```",
        explained,
        "```",
    ]
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> str:
    name = f"darkroom_bench_pages_{os.getpid()}"
    url = f"{args.pg}/{name}"
    tag = uuid.uuid4().hex[:10]
    stream, dead = f"{{bench{tag}}}:photos", f"{{bench{tag}}}:dead"
    client = redis.Redis.from_url(args.redis, decode_responses=True)
    streams = Streams(client, stream, "darkroom", "bench", dead)
    await db.migrate(url)
    admin = await asyncpg.connect(f"{args.pg}/postgres")
    await admin.execute(f'ALTER DATABASE "{name}" SET max_parallel_workers_per_gather = 0')
    web = None
    try:
        setup = {"machine": machine(), "fill_s": await fill(url, args.photos),
                 "letters_s": await add_letters(client, dead, args.letters)}  # fmt: skip
        print(setup, file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            env = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
            env |= {"DARKROOM_DATABASE_URL": url, "DARKROOM_REDIS_URL": args.redis,
                    "DARKROOM_STREAM": stream, "DARKROOM_DEAD_LETTER_STREAM": dead,
                    "DARKROOM_WEB_PORT": str(port), "DARKROOM_LOG_LEVEL": "warning",
                    "DARKROOM_STORAGE_URL": "file:./storage"}  # fmt: skip
            web = start_web(env, tmp)
            base = f"http://127.0.0.1:{port}"
            runs = {}
            conn = await asyncpg.connect(url)
            try:
                for label, path in PAGES:
                    runs[label] = await phase(base, path, args, conn, name, web.pid)
                    print(label, row(label, runs[label]), file=sys.stderr)
            finally:
                await conn.close()
            async with httpx.AsyncClient() as scraper:
                metrics = (await scraper.get(f"{base}/metrics")).text
            snapshots = next(line.split()[1] for line in metrics.splitlines()
                             if line.startswith("darkroom_web_snapshots_total "))  # fmt: skip
            web.terminate()
            web.wait(30)
        explained = await plan(url)
        old = await old_shapes(url, streams)
        return report(args, setup, runs, old, str(int(float(snapshots))), explained)
    finally:
        if web is not None and web.poll() is None:
            web.kill()
        await client.delete(stream, dead)
        await client.aclose()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=300_000)
    parser.add_argument("--letters", type=int, default=100_000)
    parser.add_argument("--viewers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, help="rewrite the `pages` section of this file")
    arguments = parser.parse_args()
    body = asyncio.run(main(arguments))
    if arguments.out:
        write_section(arguments.out, "pages", body)
        print(f"wrote the pages section of {arguments.out}", file=sys.stderr)
    else:
        print(body)
