"""Fair bulk feeding and the PostgreSQL intake, on the local Redis and PostgreSQL.

    .venv/bin/python bench/fairness.py [--seconds 130] [--out docs/benchmarks.md]

Four measurements, in a fresh database (dropped after), DARKROOM_BENCH_DATABASE or
`darkroom_bench_fairness`:
- the scheduler's cost per pick with 10,000 backlogged tenants (pure, in process);
- PostgreSQL intake: rows inserted without any XADD, commit to render start (p50, p99);
- fairness: three bulk tenants of equal weight, one with 100x the photos of the others,
  each with photos of another size, fed by this script's feeder to one worker that reads
  the bulk stream: each tenant's share of the pixels rendered per 60 s window, Jain's
  index, and a chart of per-tenant throughput (docs/bench-fairness.png);
- one tenant alone through the feeder against today's single lane (XADD per photo).
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
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pyvips
import redis

from darkroom import services
from darkroom.feeder import Feeder
from darkroom.queue.scheduler import Pending, Refill, Scheduler
from darkroom.settings import Settings
from darkroom.store import db

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import ROOT, machine, write_section

REDIS_URL = "redis://127.0.0.1:6379/0"
SERVER = "postgresql://postgres@127.0.0.1:5432"
# Another name lets two benches run side by side without dropping each other's database.
DATABASE = os.environ.get("DARKROOM_BENCH_DATABASE", "darkroom_bench_fairness")
DATABASE_URL = f"{SERVER}/{DATABASE}"
PHOTOS = ROOT / "tests" / "photos"
# Three sizes: 2.2, 0.8 and 0.2 megapixels (the busy machine renders about 2 MP/s: a larger
# photo would be a large part of a tenant's share of one 60 s window).
TENANTS = {"large": "Landscape_1.jpg", "heavy": "4.webp", "small": "embedgravitybird.png"}
HEAVY = "heavy"
WINDOW_S = 60
BIN_S = 10
# in the bench's own database: pg_locks shows the feeder locks of every database
# The feeder's leased duty held by a live lease (duty.py).
FEEDER_LOCK = "SELECT 1 FROM darkroom_duties WHERE name = 'feeder' AND expires_at > now()"


def scheduler_cost(tenants: int = 10_000, picks: int = 50_000) -> tuple[float, float]:
    """Mean and worst-of-100 µs per pick (each pick's refills included) over 10,000 tenants."""
    sched = Scheduler()
    waiting = {f"t{i}": deque(Pending(uuid.uuid4(), f"t{i}", 1_000_000 + 997 * i)
                              for _ in range(8)) for i in range(tenants)}  # fmt: skip
    for tenant in waiting:
        sched.add(tenant)
    batches: list[float] = []
    for _ in range(picks // 500):
        started = time.perf_counter()
        for _ in range(500):
            while isinstance(choice := sched.next(), Refill):
                queue = waiting[choice.tenant]
                sched.refill(choice.tenant, [queue.popleft() for _ in range(min(4, len(queue)))])
        batches.append((time.perf_counter() - started) / 500 * 1e6)
    return statistics.mean(batches), max(batches)


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []  # type: list[subprocess.Popen[str]]
        self.tag = f"fair{os.getpid()}"

    def environ(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
        return (
            base
            | {
                "DARKROOM_REDIS_URL": REDIS_URL,
                "DARKROOM_DATABASE_URL": DATABASE_URL,
                "DARKROOM_STORAGE_URL": f"file:{self.tmp / 'storage'}",
                "DARKROOM_DEAD_LETTER_STREAM": f"{{{self.tag}}}:dead",
                "DARKROOM_CONCURRENCY": "2",
                "DARKROOM_LOG_FORMAT": "json",
            }
            | extra
        )

    def worker(self, stream: str, **extra: str) -> None:
        env = self.environ(DARKROOM_STREAM=f"{{{self.tag}}}:{stream}", **extra)
        log = open(self.tmp / f"{stream}-{len(self.procs)}.log", "w")  # noqa: SIM115
        command = [sys.executable, "-m", "darkroom", "run"]
        proc = subprocess.Popen(command, env=env, cwd=self.tmp, stdout=subprocess.DEVNULL,
                                stderr=log, text=True)  # fmt: skip
        self.procs.append(proc)

    def stop_workers(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(60)
        self.procs.clear()

    def original(self, name: str) -> str:
        key = f"originals/bench/{name}"
        target = self.tmp / "storage" / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((PHOTOS / name).read_bytes())
        return key


async def wait_until(
    conn: asyncpg.Connection, sql: str, *args: Any, timeout_s: float = 600
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await conn.fetchval(sql, *args):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for: {sql}")
        await asyncio.sleep(0.1)


async def intake_latency(rig: Rig, conn: asyncpg.Connection, rows: int) -> list[float]:
    """Rows a PostgreSQL-only producer inserts one by one: commit to the claim (render start)."""
    key = rig.original(TENANTS["small"])
    rig.worker("photos")
    await wait_until(conn, FEEDER_LOCK)
    warm = uuid.uuid4()  # the first photo also waits for the render processes to start
    await conn.execute("INSERT INTO photos (id, original_key) VALUES ($1, $2)", warm, key)
    await wait_until(conn, "SELECT processed_at IS NOT NULL FROM photos WHERE id = $1", warm)
    ids = []
    for _ in range(rows):
        ids.append(uuid.uuid4())
        await conn.execute("INSERT INTO photos (id, original_key) VALUES ($1, $2)", ids[-1], key)
        await asyncio.sleep(0.3)
    done = "SELECT count(*) = $2 FROM photos WHERE id = ANY($1) AND processing_state = 'processed'"
    await wait_until(conn, done, ids, len(ids))
    rig.stop_workers()
    waits = await conn.fetch("SELECT extract(epoch FROM j.started_at - p.created_at)::float8 AS s"
                             " FROM photos p JOIN photo_jobs j ON j.photo_id = p.id"
                             " WHERE p.id = ANY($1)", ids)  # fmt: skip
    return sorted(r["s"] for r in waits)


async def insert_bulk(
    conn: asyncpg.Connection, rig: Rig, tenant: str, count: int, run: str
) -> None:
    name = TENANTS[tenant]
    key = rig.original(name)
    image = pyvips.Image.new_from_file(str(PHOTOS / name))
    await conn.execute(
        "INSERT INTO photos (id, original_key, lane, tenant, cost)"
        " SELECT gen_random_uuid(), $1, 'bulk', $2, $3 FROM generate_series(1, $4)",
        key, f"{run}{tenant}", image.width * image.height, count,
    )  # fmt: skip


async def feed_for(rig: Rig, run: str, done: Callable[[], Awaitable[bool]]) -> float:
    """This process feeds (it holds the feeder's lock) until `done`; one worker reads the
    bulk stream. Returns when the feeding started (the database's clock)."""
    conn = await asyncpg.connect(DATABASE_URL)
    tag = f"{{{rig.tag}}}"
    settings = Settings(redis_url=REDIS_URL, database_url=DATABASE_URL, stream=f"{tag}:in",
                        bulk_stream=f"{tag}:{run}bulk", dead_letter_stream=f"{tag}:dead",
                        pg_intake=False)  # fmt: skip
    streams = services.open_streams(settings)
    pool = await db.connect(DATABASE_URL, 2)
    feeder = Feeder(settings, pool, streams, anyio.Event(), "bench-fairness")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feeder.run)
        await wait_until(conn, FEEDER_LOCK)
        started = await conn.fetchval("SELECT extract(epoch FROM now())::float8")
        # the worker's own feeder never gets the lock; it reads the bulk stream as its bulk
        # lane (it says when it takes entries, and the feeder counts it for the reserve)
        rig.worker(f"{run}unused", DARKROOM_BULK_STREAM=f"{tag}:{run}bulk",
                   DARKROOM_PG_INTAKE="false")  # fmt: skip
        while not await done():  # noqa: ASYNC110 (polling the database is the point)
            await asyncio.sleep(0.2)
        rig.stop_workers()
        feeder.stop()
    await pool.close()
    await streams.client.aclose()
    await conn.close()
    return float(started)


async def pixels_by_bin(conn: asyncpg.Connection, run: str, start: float) -> dict[str, list[float]]:
    rows = await conn.fetch(
        "SELECT tenant, floor((extract(epoch FROM processed_at) - $2) / $3)::int AS bin,"
        " sum(width::bigint * height)::float8 AS px FROM photos"
        " WHERE tenant LIKE $1 || '%' AND processed_at IS NOT NULL GROUP BY 1, 2",
        run, start, BIN_S,
    )  # fmt: skip
    bins = max((r["bin"] for r in rows), default=0) + 1
    out = {t: [0.0] * bins for t in TENANTS}
    for r in rows:
        out[r["tenant"].removeprefix(run)][r["bin"]] = r["px"]
    return out


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def throughput(conn: asyncpg.Connection, where: str, *args: Any) -> float:
    """Photos per second between the first render start and the last publish."""
    row = await conn.fetchrow(
        "SELECT count(*) AS n, extract(epoch FROM max(p.processed_at) - min(j.started_at))::float8"
        f" AS s FROM photos p JOIN photo_jobs j ON j.photo_id = p.id WHERE {where}", *args
    )  # fmt: skip
    return float((row["n"] - 1) / row["s"])


async def single_lane(rig: Rig, conn: asyncpg.Connection, count: int, run: str) -> float:
    key = rig.original(TENANTS["large"])
    client = redis.Redis.from_url(REDIS_URL)
    ids = [uuid.uuid4() for _ in range(count)]
    await conn.executemany("INSERT INTO photos (id, original_key, enqueued_at)"
                           " VALUES ($1, $2, now())", [(i, key) for i in ids])  # fmt: skip
    for photo_id in ids:
        client.xadd(f"{{{rig.tag}}}:{run}", {"photo_id": str(photo_id)})
    rig.worker(run)
    done = "SELECT count(*) = $2 FROM photos WHERE id = ANY($1) AND processing_state = 'processed'"
    await wait_until(conn, done, ids, count)
    rig.stop_workers()
    client.close()
    return await throughput(conn, "p.id = ANY($1)", ids)


async def alone(rig: Rig, conn: asyncpg.Connection, count: int, run: str) -> float:
    await insert_bulk(conn, rig, "large", count, run)
    done = "SELECT count(*) = $1 FROM photos WHERE tenant = $2 AND processed_at IS NOT NULL"
    await feed_for(rig, run, lambda: conn.fetchval(done, count, f"{run}large"))
    return await throughput(conn, "p.tenant = $1", f"{run}large")


async def compare(
    rig: Rig, conn: asyncpg.Connection, count: int, rounds: int
) -> tuple[list[float], list[float]]:
    """Alternating runs (the machine is shared: one run each would measure the neighbours)."""
    single, lone = [], []
    for i in range(rounds):
        single.append(await single_lane(rig, conn, count, f"single{i}"))
        lone.append(await alone(rig, conn, count, f"alone{i}"))
    return single, lone


def plot(bins: dict[str, list[float]], graph: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for tenant, values in bins.items():
        label = f"{tenant} ({TENANTS[tenant]}{', 100x the photos' if tenant == HEAVY else ''})"
        ax.plot([i * BIN_S for i in range(len(values))], [v / BIN_S / 1e6 for v in values],
                label=label)  # fmt: skip
    ax.set_xlabel(f"seconds since the feeding started ({BIN_S} s bins)")
    ax.set_ylabel("source megapixels rendered per second")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.set_title("Bulk tenants of equal weight, fed by deficit round robin on pixels")
    fig.tight_layout()
    fig.savefig(graph, dpi=90)


def windows(bins: dict[str, list[float]], skip_bins: int) -> list[dict[str, float]]:
    """Pixels per tenant in each full 60 s window after the warm-up bins."""
    per = WINDOW_S // BIN_S
    length = min(len(v) for v in bins.values())
    starts = range(skip_bins, length - per + 1, per)
    return [{t: sum(v[s : s + per]) for t, v in bins.items()} for s in starts]


async def measure(args: argparse.Namespace, rig: Rig) -> str:
    mean_us, worst_us = scheduler_cost()
    conn = await asyncpg.connect(DATABASE_URL)
    waits = await intake_latency(rig, conn, args.intake_rows)
    for tenant in TENANTS:
        count = args.photos * (100 if tenant == HEAVY else 1)
        await insert_bulk(conn, rig, tenant, count, "fair")
    deadline = time.monotonic() + args.seconds

    async def elapsed() -> bool:
        return time.monotonic() > deadline

    start = await feed_for(rig, "fair", elapsed)
    bins = await pixels_by_bin(conn, "fair", start)
    left = await conn.fetchval(
        "SELECT min(n) FROM (SELECT count(*) AS n FROM photos WHERE"
        " tenant LIKE 'fair%' AND processed_at IS NULL GROUP BY tenant) w"
    )
    # the next runs' feeders would feed what is left of this backlog
    await conn.execute("DELETE FROM photos WHERE tenant LIKE 'fair%' AND processed_at IS NULL")
    single, lone = await compare(rig, conn, args.throughput_photos, args.rounds)
    await conn.close()
    plot(bins, args.graph)
    return report(mean_us, worst_us, waits, windows(bins, 1), left, single, lone, args)


def runs(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def report(mean_us: float, worst_us: float, waits: list[float], wins: list[dict[str, float]],
           left: int, single: list[float], lone: list[float],
           args: argparse.Namespace) -> str:  # fmt: skip
    p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))]
    lines = [
        "## Fairness and the PostgreSQL intake",
        "",
        f"`bench/fairness.py` ({machine()}). Design: [Fairness](fairness.md).",
        "",
        "| measure | target | result |",
        "|---|---|---|",
        f"| scheduler cost per pick, 10,000 backlogged tenants (mean / worst batch of 500) "
        f"| ≤ 1 ms | {mean_us:.1f} µs / {worst_us:.1f} µs |",
        f"| PostgreSQL-only row, commit → render start, {len(waits)} rows (p50 / p99 / max) "
        f"| p99 ≤ 1 s | {statistics.median(waits):.2f} s / {p99:.2f} s / {waits[-1]:.2f} s |",
        f"| one tenant alone through the feeder vs today's single lane, photos/s, median of "
        f"{len(lone)} alternating runs of {args.throughput_photos} photos | ≥ 95 % "
        f"| {statistics.median(lone):.2f} vs {statistics.median(single):.2f} = "
        f"{100 * statistics.median(lone) / statistics.median(single):.0f} % (runs: feeder "
        f"{runs(lone)}; single lane {runs(single)}) |",
        "",
        f"Three bulk tenants of equal weight, {args.photos} photos each but `{HEAVY}` with "
        f"{100 * args.photos}, of 2.2, 0.8 and 0.2 MP; one worker at concurrency 2 reads the "
        f"bulk lane, the default reserve (`DARKROOM_BULK_AHEAD=0`: its 4 regular places); "
        f"every tenant still had photos waiting at the end (fewest left: {left}). Share of "
        "the source pixels rendered in each 60 s window after a 10 s warm-up (target: each "
        "1/3 ± 10 %, Jain's index ≥ 0.95):",
        "",
        "| window | " + " | ".join(TENANTS) + " | Jain's index |",
        "|---|" + "---|" * (len(TENANTS) + 1),
    ]
    for i, win in enumerate(wins):
        total = sum(win.values())
        shares = " | ".join(f"{100 * win[t] / total:.1f} %" for t in TENANTS)
        lines.append(f"| {i + 1} | {shares} | {jain(list(win.values())):.3f} |")
    lines += ["", f"![per-tenant throughput over time]({args.graph.name})"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=140.0)
    parser.add_argument("--photos", type=int, default=600, help="per light tenant")
    parser.add_argument("--intake-rows", type=int, default=40)
    parser.add_argument("--throughput-photos", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--graph", type=Path, default=ROOT / "docs" / "bench-fairness.png")
    args = parser.parse_args()
    subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                    DATABASE], check=True)  # fmt: skip
    asyncio.run(db.migrate(DATABASE_URL))
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp))
        try:
            body = asyncio.run(measure(args, rig))
        finally:
            rig.stop_workers()
            client = redis.Redis.from_url(REDIS_URL)
            client.delete(*client.keys(f"{{{rig.tag}}}:*") or ["-"])
            client.close()
    subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                    DATABASE], check=True)  # fmt: skip
    print(body)
    if args.out:
        write_section(args.out, "fairness", body)


if __name__ == "__main__":
    main()
