"""Per-tenant rate limits with real workers, on the local Redis and PostgreSQL.

    .venv/bin/python bench/limits.py [--seconds 185] [--window 60] [--photos 2000] [--rate 20]
                                     [--weight 99] [--photo tiny|PATH] [--out docs/benchmarks.md]

In a fresh database (dropped after), DARKROOM_BENCH_DATABASE or `darkroom_bench_limits`:
`limited` (20/s, `darkroom limits set`) and `free` (no limit) each keep a backlog of at
least --photos bulk photos waiting to be fed (topped up every second: at 20/s a fixed
2,000 would drain in 100 s, and a drained tenant measures its backlog, not its limit);
three workers (concurrency 2) render them, one of them feeding. Reported per --window
after a 5 s warm-up (from the first photo started; starts are the claims' own times,
photo_jobs.started_at): `limited`'s starts per second against its rate (the ±5 % target),
`free`'s (the rest of the capacity: work conserving) and the workers' CPU per photo.

The limit binds only where `limited` would take more than its rate without it: the
photos are tiny 64×48 PNGs with one small rendition by default (`--photo PATH`,
`--renditions` for others), and `--weight` (DARKROOM_TENANT_WEIGHTS, 99:1) gives
`limited` nearly all of the lane, so it is held by its limit wherever the machine renders
over 20 photos a second (at 1:1 that took over 40; on the shared 2-core machine at load
average 30 the three workers rendered 20–24). The report says the total rate, so a
window where the limit did not bind shows. A smoke run: `--seconds 24 --window 8
--photos 400 --rate 2`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import pyvips
import redis

from darkroom.store import db

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine, write_section

REDIS_URL = "redis://127.0.0.1:6379/0"
SERVER = "postgresql://postgres@127.0.0.1:5432"
DATABASE = os.environ.get("DARKROOM_BENCH_DATABASE", "darkroom_bench_limits")
DATABASE_URL = f"{SERVER}/{DATABASE}"
WORKERS, WARM_UP_S, TOP_UP_S = 3, 5.0, 1.0
TENANTS = ("limited", "free")
RENDITIONS = "thumb:64:jpeg:80"  # one small rendition: the limit, not the render, is measured
UNFED_SQL = "SELECT tenant, count(*) AS n FROM photos WHERE enqueued_at IS NULL GROUP BY 1"
STARTS_SQL = """
SELECT p.tenant, floor((extract(epoch FROM j.started_at) - $1) / $2)::int AS window,
       count(*) AS n
FROM photos p JOIN photo_jobs j ON j.photo_id = p.id
WHERE j.started_at IS NOT NULL AND extract(epoch FROM j.started_at) >= $1
GROUP BY 1, 2
"""
# The same for the XADDs (photos.enqueued_at, set as the feeder marks a batch fed): the
# bucket charges here, so a start rate short of the fed rate is the stream, not the limit.
FED_SQL = """
SELECT tenant, floor((extract(epoch FROM enqueued_at) - $1) / $2)::int AS window,
       count(*) AS n
FROM photos WHERE enqueued_at IS NOT NULL AND extract(epoch FROM enqueued_at) >= $1
GROUP BY 1, 2
"""


class Rig:
    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.tmp, self.tag = tmp, f"limits{os.getpid()}"
        self.weight, self.renditions = args.weight, args.renditions
        self.procs: list[subprocess.Popen[str]] = []

    def environ(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
        return base | {
            "DARKROOM_REDIS_URL": REDIS_URL, "DARKROOM_DATABASE_URL": DATABASE_URL,
            "DARKROOM_STORAGE_URL": f"file:{self.tmp / 'storage'}",
            "DARKROOM_STREAM": f"{{{self.tag}}}:photos",
            "DARKROOM_DEAD_LETTER_STREAM": f"{{{self.tag}}}:dead",
            "DARKROOM_EVENTS_STREAM": f"{{{self.tag}}}:events",
            "DARKROOM_CONCURRENCY": "2", "DARKROOM_LOG_FORMAT": "json",
            "DARKROOM_HISTORY": "false", "DARKROOM_OPERATOR": "bench",
            "DARKROOM_TENANT_WEIGHTS": f"limited={self.weight}",
            "DARKROOM_RENDITIONS": self.renditions,
        }  # fmt: skip

    def cli(self, *args: str) -> None:
        subprocess.run([sys.executable, "-m", "darkroom", *args], env=self.environ(),
                       cwd=self.tmp, check=True, capture_output=True)  # fmt: skip

    def worker(self) -> None:
        log = open(self.tmp / f"worker-{len(self.procs)}.log", "w")  # noqa: SIM115
        command = [sys.executable, "-m", "darkroom", "run"]
        proc = subprocess.Popen(command, env=self.environ(), cwd=self.tmp,
                                stdout=subprocess.DEVNULL, stderr=log, text=True)  # fmt: skip
        self.procs.append(proc)

    def stop_workers(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(60)
        self.procs.clear()


def original(rig: Rig, photo: str) -> tuple[str, int]:
    """The one original every photo points at, and its pixels (the photos' cost)."""
    key = "originals/bench/photo.png"
    target = rig.tmp / "storage" / key
    target.parent.mkdir(parents=True, exist_ok=True)
    if photo == "tiny":  # a 64×48 RGB PNG, as bench/e2e.py's tiny photos
        noise = pyvips.Image.gaussnoise(64, 48, mean=128, sigma=30)
        noise.bandjoin([noise, noise]).cast("uchar").pngsave(str(target))
    else:
        target.write_bytes(Path(photo).read_bytes())
    image = pyvips.Image.new_from_file(str(target))
    return key, image.width * image.height


async def add(conn: asyncpg.Connection, original: tuple[str, int], tenant: str, n: int) -> None:
    await conn.execute(
        "INSERT INTO photos (id, original_key, lane, tenant, cost)"
        " SELECT gen_random_uuid(), $1, 'bulk', $2, $3 FROM generate_series(1, $4)",
        original[0], tenant, original[1], n,
    )  # fmt: skip


async def top_up(conn: asyncpg.Connection, original: tuple[str, int], photos: int) -> int:
    """Each tenant's unfed backlog back to `photos`; the smallest it was found at."""
    unfed = {row["tenant"]: row["n"] for row in await conn.fetch(UNFED_SQL)}
    for tenant in TENANTS:
        if (short := photos - unfed.get(tenant, 0)) > 0:
            await add(conn, original, tenant, short)
    return min(unfed.get(tenant, 0) for tenant in TENANTS)


async def keep_topped_up(original: tuple[str, int], photos: int, lowest: list[int]) -> None:
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        while True:
            lowest[0] = min(lowest[0], await top_up(conn, original, photos))
            await asyncio.sleep(TOP_UP_S)
    finally:
        await conn.close()


async def measure(args: argparse.Namespace, rig: Rig) -> dict[str, object]:
    conn = await asyncpg.connect(DATABASE_URL)
    rate = f"{args.rate:g}/s"
    rig.cli("limits", "set", "limited", rate, "--burst", str(max(1, round(args.rate))))
    photo = original(rig, args.photo)
    lowest = [args.photos]
    await top_up(conn, photo, args.photos)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    feeding = asyncio.create_task(keep_topped_up(photo, args.photos, lowest))
    for _ in range(WORKERS):
        rig.worker()
    first = "SELECT extract(epoch FROM min(started_at))::float8 FROM photo_jobs"
    while await conn.fetchval(first) is None:  # noqa: ASYNC110 (the workers' self-checks)
        await asyncio.sleep(0.2)
    await asyncio.sleep(WARM_UP_S)
    lowest[0] = args.photos  # from the measured windows on
    started, load = time.time(), os.getloadavg()
    await asyncio.sleep(args.seconds)
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg(), strict=True))
    rig.stop_workers()
    feeding.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await feeding
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    windows = int(args.seconds // args.window)
    counts = await per_window(conn, STARTS_SQL, started, args.window, windows)
    fed = await per_window(conn, FED_SQL, started, args.window, windows)
    done = await conn.fetchval("SELECT count(*) FROM photos WHERE processed_at IS NOT NULL")
    await conn.close()
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"counts": counts, "fed": fed, "cpu_per_photo_s": cpu_s / max(1, done),
            "lowest": lowest[0], "pixels": photo[1], "load": load}  # fmt: skip


async def per_window(
    conn: asyncpg.Connection, sql: str, started: float, window_s: float, windows: int
) -> dict[str, list[int]]:
    counts = {t: [0] * windows for t in TENANTS}
    for row in await conn.fetch(sql, started, window_s):
        if row["window"] < windows:
            counts[row["tenant"]][row["window"]] = row["n"]
    return counts


def report(figures: dict[str, object], args: argparse.Namespace) -> str:
    counts: dict[str, list[int]] = figures["counts"]  # type: ignore[assignment]
    window_s, weight = args.window, f", weight {args.weight}:1," if args.weight > 1 else ""
    load = "/".join(f"{x:.1f}" for x in figures["load"])  # type: ignore[attr-defined]
    lines = [
        "## Per-tenant rate limits (bench/limits.py)",
        "",
        f"`bench/limits.py` ({machine()}; the highest load average during the run {load}; a",
        "machine shared with other jobs). Design: [Fairness](fairness.md#rate-limits).",
        "",
        f"`limited` at {args.rate:g}/s (burst {max(1, round(args.rate))}){weight} and `free` "
        f"without a limit, each with at least {args.photos:,} bulk photos of "
        f"{figures['pixels']:,} pixels waiting (topped up every {TOP_UP_S:g} s; fewest seen in",
        f"the windows: {figures['lowest']:,}), {WORKERS} workers at concurrency 2, renditions",
        f"`{args.renditions}`; photos started (claimed, photo_jobs.started_at) and fed (XADDed)",
        f"per second in each {window_s:g} s window after a {WARM_UP_S:g} s warm-up. Target:",
        "`limited` within ±5 % of its rate in every window, `free` taking the rest.",
        "",
        "| window | limited /s | off the limit | limited fed /s | free /s | all /s |",
        "|---|---|---|---|---|---|",
    ]
    fed = figures["fed"]["limited"]  # type: ignore[index]
    for i, (lim, free) in enumerate(zip(counts["limited"], counts["free"], strict=True)):
        rate = lim / window_s
        lines.append(f"| {i + 1} | {rate:.2f} | {100 * (rate / args.rate - 1):+.1f} % | "
                     f"{fed[i] / window_s:.2f} | {free / window_s:.2f} | "
                     f"{(lim + free) / window_s:.2f} |")  # fmt: skip
    cpu_ms = 1000 * figures["cpu_per_photo_s"]  # type: ignore[operator]
    lines += ["", f"Workers' CPU: {cpu_ms:.0f} ms per photo processed."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=185.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--photos", type=int, default=2000, help="per tenant, kept waiting")
    parser.add_argument("--rate", type=float, default=20.0, help="limited's, photos a second")
    parser.add_argument("--weight", type=int, default=99, help="limited's fair-share weight")
    parser.add_argument("--photo", default="tiny", help="tiny (64×48 PNG) or a file")
    parser.add_argument("--renditions", default=RENDITIONS, help="DARKROOM_RENDITIONS")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    drop = ["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", DATABASE]
    subprocess.run(drop, check=True)
    asyncio.run(db.migrate(DATABASE_URL))
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp), args)
        try:
            figures = asyncio.run(measure(args, rig))
        finally:
            rig.stop_workers()
            client = redis.Redis.from_url(REDIS_URL)
            client.delete(*client.keys(f"{{{rig.tag}}}:*") or ["-"])
            client.close()
    subprocess.run(drop, check=True)
    body = report(figures, args)
    print(body)
    if args.out:
        write_section(args.out, "limits", body)


if __name__ == "__main__":
    main()
