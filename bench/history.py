"""What the attempt history costs: end-to-end throughput with it on and off, the cost of its
two statements per delivery, and a day's deletion timed while workers run.

    .venv/bin/python bench/history.py [--out docs/benchmarks.md] [--rows 300000] [--rounds 3]

Real `darkroom run --drain` workers (bench/e2e.py's rig) against a database of its own,
`darkroom_bench_history`, on 300 tiny 64×48 PNGs: the workload where a fixed per-photo
cost shows most (a camera photo's render is 100× longer). DARKROOM_HISTORY=true and false
alternate, `--rounds` times each. Then `--rows` expired rows (one day's, 40 days old) are
deleted by `recorder.prune_expired` while a worker drains the PNGs and a probe writes a
delivery's two statements every 10 ms: the probe's latency says whether the deletion
blocks the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from e2e import Rig, Run, tiny_pngs
from report import machine, write_section

from darkroom import recorder
from darkroom.store import db, history

DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/darkroom_bench_history"
PROBE_EVERY_S = 0.01
# A 12 MP camera JPEG's CPU per photo, worker + render processes (bench/e2e.py's section).
CAMERA_CPU_MS = 254.9


class HistoryRig(Rig):
    """bench/e2e.py's rig on this script's own database (e2e.py may run beside it)."""

    def environ(self, stream: str, **extra: str) -> dict[str, str]:
        return super().environ(stream, **extra) | {"DARKROOM_DATABASE_URL": DATABASE_URL}

    def setup(self) -> None:
        subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                        "darkroom_bench_history"], check=True)  # fmt: skip
        self.cli("bench-history", "migrate")


def on_off(rig: Rig, paths: list[Path], rounds: int) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {"true": [], "false": []}
    for i in range(rounds):
        for setting in ("true", "false") if i % 2 == 0 else ("false", "true"):
            runs[setting].append(rig.drain(paths, DARKROOM_HISTORY=setting))
            print(f"  history={setting}: {runs[setting][-1].per_s:.1f}/s", file=sys.stderr)
    return runs


def cpu_s(pid: int) -> float:
    """User + system CPU of a process so far (utime and stime of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def statement_cost(pool: db.Pool, pairs: int = 3000) -> tuple[float, float]:
    """One delivery's two statements (start, finish), in sequence: wall µs, and CPU µs of
    this client and its PostgreSQL backend (CPU time, unlike wall time, is not inflated
    by the other processes of a shared machine)."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, "originals/bench")
    async with pool.acquire() as conn:
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        started, cpu0 = time.perf_counter(), time.process_time() + cpu_s(backend)
        for i in range(pairs):
            attempt = history.Attempt(
                await history.start(conn, photo_id, f"{i}-0", "bench", "interactive")
            )
            await history.finish(conn, attempt, history.Ending("published"))
        cpu = time.process_time() + cpu_s(backend) - cpu0
    return (time.perf_counter() - started) / pairs * 1e6, cpu / pairs * 1e6


async def fill_expired_day(pool: db.Pool, rows: int) -> None:
    await pool.execute(
        "INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane, started_at, ended_at,"
        " render_ms, outcome) SELECT gen_random_uuid(), i || '-0', 'old', 'interactive',"
        " now() - interval '40 days' + i * interval '86 s' / $1 * 1000, now(), 100, 'published'"
        " FROM generate_series(1, $1) i",
        rows,
    )
    await pool.execute("VACUUM ANALYZE photo_attempts")


async def probe(pool: db.Pool, stop: asyncio.Event, latencies_ms: list[float]) -> None:
    """A worker's two history statements, every 10 ms, each pair's latency."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, "originals/probe")
    while not stop.is_set():
        started = time.perf_counter()
        attempt = history.Attempt(
            await history.start(pool, photo_id, "probe-0", "probe", "interactive")
        )
        await history.finish(pool, attempt, history.Ending("published"))
        latencies_ms.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(PROBE_EVERY_S)


async def timed_prune(pool: db.Pool, rig: Rig, paths: list[Path]) -> dict[str, Any]:
    """While a worker drains `paths`: the probe for 5 s alone, then during the prune."""
    before: list[float] = []
    during: list[float] = []
    drained: dict[str, Run] = {}
    worker = threading.Thread(target=lambda: drained.setdefault("run", rig.drain(paths)))
    worker.start()
    await asyncio.sleep(3)  # the worker has ingested, started and is rendering
    stop = asyncio.Event()
    baseline = asyncio.create_task(probe(pool, stop, before))
    await asyncio.sleep(5)
    stop.set()
    await baseline
    stop = asyncio.Event()
    probing = asyncio.create_task(probe(pool, stop, during))
    started = time.perf_counter()
    deleted = await recorder.prune_expired(pool, 30)
    prune_s = time.perf_counter() - started
    stop.set()
    await probing
    await asyncio.to_thread(worker.join)
    return {"deleted": deleted, "prune_s": prune_s, "before": before, "during": during,
            "run": drained["run"]}  # fmt: skip


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def measure(
    rig: Rig, paths: list[Path], rows: int
) -> tuple[tuple[float, float], dict[str, Any]]:
    pool = await db.connect(DATABASE_URL, 4)
    try:
        cost_us = await statement_cost(pool)
        await fill_expired_day(pool, rows)
        return cost_us, await timed_prune(pool, rig, paths * 3)
    finally:
        await pool.close()


def report(
    runs: dict[str, list[Run]], cost: tuple[float, float], prune: dict[str, Any], rows: int
) -> str:
    on = statistics.median(r.per_s for r in runs["true"])
    off = statistics.median(r.per_s for r in runs["false"])
    cpu_on = statistics.median(r.cpu_ms / r.photos for r in runs["true"])
    cpu_off = statistics.median(r.cpu_ms / r.photos for r in runs["false"])
    wall_us, cpu_us = cost
    b, d = prune["before"], prune["during"]
    batches = -(-prune["deleted"] // recorder.PRUNE_BATCH)
    return "\n".join([
        "## Attempt history (bench/history.py)", "",
        f"- {machine()}",
        f"- 300 tiny 64×48 PNGs through one `darkroom run --drain` worker; DARKROOM_HISTORY "
        f"on and off alternate, {len(runs['true'])} drains each, median photos/s", "",
        "| history | photos/s (median) | each drain | CPU ms per photo, worker + render "
        "processes (median) |", "|---|---:|---|---:|",
        f"| on | {on:.1f} | {', '.join(f'{r.per_s:.1f}' for r in runs['true'])} | {cpu_on:.1f} |",
        f"| off | {off:.1f} | {', '.join(f'{r.per_s:.1f}' for r in runs['false'])} | "
        f"{cpu_off:.1f} |", "",
        f"The two statements of one delivery (INSERT at the claim, UPDATE at the end, "
        f"asynchronous commits) cost **{cpu_us:.0f} µs of CPU** (this client and its "
        f"PostgreSQL backend, 3,000 pairs in sequence; {wall_us:.0f} µs "
        f"of wall time on this loaded machine): **{100 * cpu_us / 1000 / cpu_off:.1f} %** of "
        f"a tiny PNG's {cpu_off:.1f} ms of worker and render CPU (Redis and PostgreSQL server "
        f"CPU for the photo's own statements not counted, so the true share is lower), and "
        f"{100 * cpu_us / 1000 / CAMERA_CPU_MS:.2f} % of a camera JPEG's {CAMERA_CPU_MS} ms "
        f"(bench/e2e.py). On "
        f"a CPU-bound machine throughput goes as 1 / CPU per photo, so that is the throughput "
        f"cost. The drains' photos/s differ by {100 * (off - on) / off:+.1f} %, within their "
        f"own spread on this shared machine (load average above).",
        "",
        f"### Deleting one day ({rows:,} rows, 40 days old) while a worker drains", "",
        f"- `recorder.prune_expired`: {prune['deleted']:,} rows in {prune['prune_s']:.1f} s, "
        f"{batches} batches of {recorder.PRUNE_BATCH:,} with {recorder.PRUNE_PAUSE_S:g} s "
        f"pauses ({prune['prune_s'] / max(batches, 1) * 1000 - recorder.PRUNE_PAUSE_S * 1000:.0f}"
        f" ms per DELETE)",
        f"- a worker's two history statements, every 10 ms: p50 {pct(b, 50):.2f} ms, p99 "
        f"{pct(b, 99):.2f} ms, max {max(b):.1f} ms in the 5 s before (the worker draining); "
        f"p50 {pct(d, 50):.2f} ms, p99 "
        f"{pct(d, 99):.2f} ms, max {max(d):.1f} ms during the deletion ({len(d)} probes)",
        f"- the worker draining 900 tiny PNGs meanwhile (the deletion took part of that "
        f"drain): {prune['run'].per_s:.1f} photos/s (history on, no deletion: {on:.1f})", "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the history section of this report")
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="darkroom-bench-history-") as name:
        rig = HistoryRig(Path(name))
        rig.setup()
        paths = tiny_pngs(Path(name) / "tiny", 300)
        print("history on and off", file=sys.stderr)
        runs = on_off(rig, paths, args.rounds)
        print(f"statement cost, then deleting {args.rows} rows while draining", file=sys.stderr)
        cost_us, prune = asyncio.run(measure(rig, paths, args.rows))
    body = report(runs, cost_us, prune, args.rows)
    print(body)
    if args.out:
        write_section(args.out, "history", body)


if __name__ == "__main__":
    main()
