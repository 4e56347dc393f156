"""Flat as the tables grow: the same drain, `status`, the page's main views and /metrics on
an empty database and on one holding 1,000,000 finished photos, on the local PostgreSQL and
Redis.

    .venv/bin/python bench/flat.py [--rows 1000000] [--photos 300] [--out docs/benchmarks.md]

In two databases of its own (`darkroom_bench_flat_empty` and `_full`, dropped after): one
left empty (but for the drains' own photos), one filled with `--rows` processed photos
with their jobs, one attempt and one published event each
(`INSERT ... SELECT generate_series`, as bench/sweep.py and bench/pages.py fill theirs; the
photos finished over the last 6 days, inside every retention, so no cleanup runs during the
measurement; VACUUM ANALYZE after). Each is measured ALTERNATIONS (3) times, in turns
(empty, full, full, empty, empty, full), and each figure is the median of its turns:
- a drain of `--photos` tiny PNGs by one `darkroom run --drain` worker: photos/s, and the
  CPU of the database sessions per photo (utime + stime from /proc of every backend on the
  database, sampled every 0.1 s);
- `status` (`ops.status_report`, what `darkroom status` prints) and one overview snapshot
  (`pages.overview_data`: what the page's overview, `/api/status` and `/metrics` show),
  in process, median of 20, with the database CPU per call;
- `darkroom web` over HTTP, one request every 0.6 s (past DARKROOM_WEB_SNAPSHOT_S=0.5, so
  each loads its snapshot): `/`, `/photos` and `/metrics`, median of 15.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import capacity
import e2e
import httpx
from pages import backends, cpu_s, free_port, start_web
from report import machine, write_section

from darkroom.operate import ops
from darkroom.operate.finished import Finished
from darkroom.operate.web import pages as web_pages
from darkroom.queue.streams import Streams, connect
from darkroom.store import db

# Two databases side by side, measured in alternating rounds (empty, full, full, empty,
# ...): a shared machine's load moves within minutes, and a single run of each compared
# one load with another.
NAMES = {"empty": "darkroom_bench_flat_empty", "full": "darkroom_bench_flat_full"}
ALTERNATIONS = 3
ROUNDS = 20
REQUESTS = 15
VIEWS = {"overview `/`": "/", "photos `/photos`": "/photos", "`/metrics`": "/metrics"}

# --rows finished photos over the last 6 days (inside the events' 7 and the history's 30
# days of retention): a processed, published photo, as a publish leaves it.
PHOTOS_SQL = """
INSERT INTO photos (id, original_key, processing_state, visibility, width, height, format,
                    bytes, renditions, created_at, updated_at, processed_at,
                    last_activity_at, enqueued_at)
SELECT id, 'originals/' || id || '/flat.jpg', 'processed', 'published', 4000, 3000, 'jpeg',
       2000000, '[{"name": "thumb", "key": "renditions/x/thumb.webp"}]'::jsonb,
       at - interval '3 seconds', at, at, at, at - interval '3 seconds'
FROM (SELECT gen_random_uuid() AS id,
             now() - interval '10 minutes' - (i * ($1::float8 / $2) * interval '1 second') AS at
      FROM generate_series(1, $2) AS i) rows
"""
JOBS_SQL = """
INSERT INTO photo_jobs (photo_id, type, state, attempt, stream_entry, consumer, created_at,
                        updated_at, started_at, finished_at, lease_token)
SELECT id, 'process', 'done', 1, '1-0', 'bench', created_at, updated_at,
       updated_at - interval '2 seconds', updated_at, 1
FROM photos WHERE original_key LIKE '%/flat.jpg'
"""
ATTEMPTS_SQL = """
INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane, started_at, ended_at,
                            download_ms, render_ms, upload_ms, publish_ms, outcome, peak_rss_mb)
SELECT id, '1-0', 'bench', 'interactive', updated_at - interval '2 seconds', updated_at,
       20, 1500, 300, 5, 'published', 180
FROM photos WHERE original_key LIKE '%/flat.jpg'
"""
EVENTS_SQL = """
INSERT INTO photo_events (photo_id, type, data, created_at, published_at)
SELECT id, 'darkroom.photo.published',
       jsonb_build_object('photo_id', id, 'renditions', renditions), updated_at, updated_at
FROM photos WHERE original_key LIKE '%/flat.jpg'
"""
SIX_DAYS_S = 6 * 86400


def url(name: str) -> str:
    return f"postgresql://postgres@127.0.0.1:5432/{name}"


def use(label: str) -> str:
    """Point the rig (its CLI runs and the drain's session CPU) at one of the databases."""
    e2e.DATABASE_URL, capacity.DATABASE = url(NAMES[label]), NAMES[label]
    return NAMES[label]


async def fill(rows: int) -> float:
    started = time.perf_counter()
    conn = await asyncpg.connect(url(NAMES["full"]))
    try:
        await conn.execute(PHOTOS_SQL, SIX_DAYS_S, rows)
        for sql in (JOBS_SQL, ATTEMPTS_SQL, EVENTS_SQL):
            await conn.execute(sql)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - started


def drain(rig: e2e.Rig, paths: list[Path]) -> dict[str, float]:
    sessions = capacity.SessionCpu()
    run = rig.drain(paths)
    pg_cpu_s = sessions.stop()
    return {"per_s": (run.photos - 1) / run.seconds, "pg_ms": pg_cpu_s * 1000 / run.photos,
            "worker_ms": run.cpu_ms / run.photos}  # fmt: skip


async def in_process(streams: Streams, name: str) -> dict[str, dict[str, float]]:
    pool = await db.connect(url(name), 2)
    admin = await asyncpg.connect(url(name))
    try:
        finished = Finished()
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "status": lambda: ops.status_report(pool, streams),
            # The web process keeps the charts' finished minutes between snapshots: so does this.
            "overview snapshot": lambda: web_pages.overview_data(pool, streams, finished),
        }
        return {label: await timed(call, admin, name) for label, call in calls.items()}
    finally:
        await admin.close()
        await pool.close()


async def timed(
    call: Callable[[], Awaitable[Any]], admin: asyncpg.Connection, name: str
) -> dict[str, float]:
    """Median ms of ROUNDS calls, and the database CPU ms per call."""
    await call()  # warm: the pool's connections, their prepared statements
    before = {pid: cpu_s(pid) for pid in await backends(admin, name)}
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1000)
    after = {pid: cpu_s(pid) for pid in await backends(admin, name)}
    used = sum(t - before.get(pid, 0.0) for pid, t in after.items())
    return {"ms": statistics.median(times), "pg_ms": used * 1000 / ROUNDS}


def over_http(rig: e2e.Rig, stream: str) -> dict[str, float]:
    port = free_port()
    env = rig.environ(stream, DARKROOM_WEB_PORT=str(port), DARKROOM_WEB_SNAPSHOT_S="0.5",
                      DARKROOM_LOG_LEVEL="warning")  # fmt: skip
    web = start_web(env, str(rig.tmp))
    try:
        return {label: median_get(f"http://127.0.0.1:{port}{path}") for label, path in
                VIEWS.items()}  # fmt: skip
    finally:
        web.terminate()
        web.wait(30)


def median_get(address: str) -> float:
    times = []
    with httpx.Client(timeout=60) as client:
        client.get(address).raise_for_status()
        for _ in range(REQUESTS):
            time.sleep(0.6)
            started = time.perf_counter()
            client.get(address).raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(rig: e2e.Rig, paths: list[Path], label: str) -> dict[str, Any]:
    name = use(label)
    print(f"  {label}: drain", file=sys.stderr)
    found: dict[str, Any] = {"drain": drain(rig, paths)}
    print(f"  {label}: drain {found['drain']}", file=sys.stderr)
    stream = f"flat-{label}-{os.getpid()}"
    streams = Streams(connect(e2e.REDIS_URL), f"{{{stream}}}:photos", "darkroom", "bench",
                      f"{{{stream}}}:dead")  # fmt: skip
    found["calls"] = asyncio.run(in_process(streams, name))
    print(f"  {label}: web", file=sys.stderr)
    found["http"] = over_http(rig, stream)
    return found


def alternating(rig: e2e.Rig, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Each database measured ALTERNATIONS times, in ABBA order; the medians."""
    found: dict[str, list[dict[str, Any]]] = {"empty": [], "full": []}
    for i in range(ALTERNATIONS):
        for label in ("empty", "full") if i % 2 == 0 else ("full", "empty"):
            found[label].append(measure(rig, paths, label))
    return {label: medians(runs) for label, runs in found.items()}


def medians(runs: list[Any]) -> Any:
    """The median of each figure over the runs (dicts of the same shape)."""
    if isinstance(runs[0], dict):
        return {key: medians([run[key] for run in runs]) for key in runs[0]}
    return statistics.median(runs)


def ratio(full: float, empty: float) -> str:
    return f"{100 * full / empty:.0f} %" if empty else "n/a"


def report(head: str, rows: int, fill_s: float, empty: dict[str, Any], full: dict[str, Any],
           photos: int) -> str:  # fmt: skip
    lines = [
        "## Flat as the tables grow",
        "",
        f"`bench/flat.py` ({head}; a machine shared with other jobs). "
        f"The same measures on an empty database and on one holding {rows:,} processed photos "
        f"(each measured {ALTERNATIONS} times in alternating turns; medians) "
        f"with their jobs, one attempt and one published event each (filled in {fill_s:.0f} s, "
        "then VACUUM ANALYZE). Target: the full database within 10 % of the empty one.",
        "",
        "| measure | empty | full | full ÷ empty |",
        "|---|---:|---:|---:|",
    ]
    e, f = empty["drain"], full["drain"]
    lines += [
        f"| drain of {photos} tiny PNGs, photos/s | {e['per_s']:.1f} | {f['per_s']:.1f} "
        f"| {ratio(f['per_s'], e['per_s'])} |",
        f"| database CPU per photo (drain), ms | {e['pg_ms']:.2f} | {f['pg_ms']:.2f} "
        f"| {ratio(f['pg_ms'], e['pg_ms'])} |",
        f"| worker CPU per photo (drain), ms | {e['worker_ms']:.1f} | {f['worker_ms']:.1f} "
        f"| {ratio(f['worker_ms'], e['worker_ms'])} |",
    ]
    for name in empty["calls"]:
        ec, fc = empty["calls"][name], full["calls"][name]
        lines += [
            f"| {name}, in process, ms (median of {ROUNDS}) | {ec['ms']:.1f} | {fc['ms']:.1f} "
            f"| {ratio(fc['ms'], ec['ms'])} |",
            f"| {name}, database CPU per call, ms | {ec['pg_ms']:.1f} | {fc['pg_ms']:.1f} "
            f"| {ratio(fc['pg_ms'], ec['pg_ms'])} |",
        ]
    for label in VIEWS:
        eh, fh = empty["http"][label], full["http"][label]
        lines.append(f"| {label} over HTTP, fresh snapshot, ms (median of {REQUESTS}) "
                     f"| {eh:.1f} | {fh:.1f} | {ratio(fh, eh)} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--photos", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(e2e.PR_SET_CHILD_SUBREAPER, 1)  # render processes' CPU counted
    head = machine()
    with tempfile.TemporaryDirectory(prefix="darkroom-flat-") as name:
        tmp = Path(name)
        rig = e2e.Rig(tmp)
        try:
            for label in NAMES:
                use(label)
                rig.setup()
            paths = e2e.tiny_pngs(tmp / "tiny", args.photos)
            print(f"  filling {args.rows:,} photos", file=sys.stderr)
            fill_s = asyncio.run(fill(args.rows))
            both = alternating(rig, paths)
        finally:
            for database in NAMES.values():
                subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                                "--force", database], check=True)  # fmt: skip
    body = report(head, args.rows, fill_s, both["empty"], both["full"], args.photos)
    print(body)
    if args.out:
        write_section(args.out, "flat", body)


if __name__ == "__main__":
    main()
