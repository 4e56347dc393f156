"""Per-tenant rate limits with real workers, on the local Redis and PostgreSQL.

    .venv/bin/python bench/limits.py [--seconds 200] [--window 60] [--photos 2000] [--rate 20]
                                     [--out docs/benchmarks.md]

In a fresh database (dropped after), DARKROOM_BENCH_DATABASE or `darkroom_bench_limits`:
`limited` (20/s, `darkroom limits set`) and `free` (no limit) each have a backlog of
--photos small bulk photos; three workers (concurrency 2) render them, one of them
feeding. Reported per --window after a 5 s warm-up (from the first photo started):
`limited`'s starts per second against its 20/s (the ±5 % target), `free`'s (the rest of
the capacity: work conserving) and the workers' CPU seconds per photo. A smoke run:
`--seconds 24 --window 8 --photos 400 --rate 1` (a rate below a busy machine's capacity:
at 20/s the machine must render well over 20 photos a second, or the limit never binds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import redis

from darkroom.store import db

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import ROOT, machine, write_section

REDIS_URL = "redis://127.0.0.1:6379/0"
SERVER = "postgresql://postgres@127.0.0.1:5432"
DATABASE = os.environ.get("DARKROOM_BENCH_DATABASE", "darkroom_bench_limits")
DATABASE_URL = f"{SERVER}/{DATABASE}"
PHOTO = ROOT / "tests" / "photos" / "embedgravitybird.png"  # 0.2 MP: capacity well past 20/s
WORKERS, WARM_UP_S = 3, 5.0
STARTS_SQL = """
SELECT p.tenant, floor((extract(epoch FROM j.started_at) - $1) / $2)::int AS window,
       count(*) AS n
FROM photos p JOIN photo_jobs j ON j.photo_id = p.id
WHERE j.started_at IS NOT NULL AND extract(epoch FROM j.started_at) >= $1
GROUP BY 1, 2
"""


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.tag = tmp, f"limits{os.getpid()}"
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


async def backlog(conn: asyncpg.Connection, rig: Rig, photos: int) -> None:
    key = "originals/bench/photo.png"
    target = rig.tmp / "storage" / key
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(PHOTO.read_bytes())
    for tenant in ("limited", "free"):
        await conn.execute(
            "INSERT INTO photos (id, original_key, lane, tenant, cost)"
            " SELECT gen_random_uuid(), $1, 'bulk', $2, 200000 FROM generate_series(1, $3)",
            key, tenant, photos,
        )  # fmt: skip


async def measure(args: argparse.Namespace, rig: Rig) -> tuple[dict[str, list[int]], float]:
    conn = await asyncpg.connect(DATABASE_URL)
    rate = f"{args.rate:g}/s"
    rig.cli("limits", "set", "limited", rate, "--burst", str(max(1, round(args.rate))))
    await backlog(conn, rig, args.photos)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(WORKERS):
        rig.worker()
    first = "SELECT extract(epoch FROM min(started_at))::float8 FROM photo_jobs"
    while await conn.fetchval(first) is None:  # noqa: ASYNC110 (the workers' self-checks)
        await asyncio.sleep(0.2)
    await asyncio.sleep(WARM_UP_S)
    started = time.time()
    await asyncio.sleep(args.seconds)
    rig.stop_workers()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    windows = int(args.seconds // args.window)
    rows = await conn.fetch(STARTS_SQL, started, args.window)
    counts = {t: [0] * windows for t in ("limited", "free")}
    for row in rows:
        if row["window"] < windows:
            counts[row["tenant"]][row["window"]] = row["n"]
    done = await conn.fetchval("SELECT count(*) FROM photos WHERE processed_at IS NOT NULL")
    await conn.close()
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return counts, cpu_s / max(1, done)


def report(counts: dict[str, list[int]], cpu_per_photo_s: float, args: argparse.Namespace) -> str:
    window_s = args.window
    lines = [
        f"Per-tenant rate limits ({machine()}): `limited` at {args.rate:g}/s and `free` without a",
        f"limit, each with a bulk backlog, {WORKERS} workers at concurrency 2; photos started",
        f"per second in each {window_s:g} s window after a {WARM_UP_S:g} s warm-up.",
        "",
        "| window | limited /s | off the limit | free /s |",
        "|---|---|---|---|",
    ]
    for i, (lim, free) in enumerate(zip(counts["limited"], counts["free"], strict=True)):
        rate = lim / window_s
        lines.append(f"| {i + 1} | {rate:.2f} | {100 * (rate / args.rate - 1):+.1f} % | "
                     f"{free / window_s:.2f} |")  # fmt: skip
    lines += ["", f"Workers' CPU: {cpu_per_photo_s * 1000:.0f} ms per photo processed."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--photos", type=int, default=2000, help="per tenant")
    parser.add_argument("--rate", type=float, default=20.0, help="limited's, photos a second")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    drop = ["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", DATABASE]
    subprocess.run(drop, check=True)
    asyncio.run(db.migrate(DATABASE_URL))
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp))
        try:
            counts, cpu_per_photo_s = asyncio.run(measure(args, rig))
        finally:
            rig.stop_workers()
            client = redis.Redis.from_url(REDIS_URL)
            client.delete(*client.keys(f"{{{rig.tag}}}:*") or ["-"])
            client.close()
    subprocess.run(drop, check=True)
    body = report(counts, cpu_per_photo_s, args)
    print(body)
    if args.out:
        write_section(args.out, "limits", body)


if __name__ == "__main__":
    main()
