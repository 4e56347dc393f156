"""Pause and resume under load, with real workers, on the local Redis and PostgreSQL.

    .venv/bin/python bench/pause.py [--pauses 100] [--cycles 1000] [--smoke]
                                    [--out docs/benchmarks.md]

In a fresh database (dropped after), DARKROOM_BENCH_DATABASE or `darkroom_bench_pause`,
and Redis keys under a hash tag of its own: three `darkroom run` workers (concurrency 2)
render tiny photos of three tenants in both lanes, a steady backlog (bulk rows topped up
for the feeder, interactive uploads XADDed, each kept at its level). Then:

1. `--pauses` pauses through the store call `darkroom pause` runs (scopes in turn: a
   lane, a tenant, a tenant's lane, everything), each held HOLD_S, then resumed. A
   pause is *effective* at T when no claim of its scope starts after T: the time is the
   last claim of the scope (photo_attempts.started_at, the claim's own transaction
   start, PostgreSQL's clock) after the pause's `since` (its transaction's start, at or
   before its commit: the figure is an upper bound), 0 when none started after. Beside
   it, when each worker heard of the pause (its `pauses changed` log line): from then
   on it reads no entry of a paused lane.
2. `--cycles` pause/resume cycles through the same store calls, random scopes and
   holds; one in ten a timed pause that runs out by itself. Then everything is resumed
   and the backlog drains; every photo must end published exactly once: one `published`
   attempt, one counted attempt, one `published` event, its renditions' objects and no
   other, nothing left pending or dead-lettered.

`--smoke`: 10 pauses and 40 cycles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from darkroom.queue.messages import task_fields
from darkroom.store import audit, db, pauses

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pause_ledger import CLAIMS, drain, ledger
from report import ROOT, machine, write_section

REDIS_URL = "redis://127.0.0.1:6379/0"
SERVER = "postgresql://postgres@127.0.0.1:5432"
DATABASE = os.environ.get("DARKROOM_BENCH_DATABASE", "darkroom_bench_pause")
DATABASE_URL = f"{SERVER}/{DATABASE}"
PHOTO = ROOT / "tests" / "photos" / "embedgravitybird.png"  # 0.2 MP: a steady stream of claims
ORIGINAL = "originals/bench/photo.png"
WORKERS, TENANTS = 3, ("t1", "t2", "t3")
SCOPES: list[tuple[str | None, str | None]] = [
    ("bulk", None), (None, "t1"), ("interactive", None), ("bulk", "t2"), (None, None),
    (None, "t3"),
]  # fmt: skip
BULK_LEVEL = 100  # unfinished bulk photos kept per tenant
INTERACTIVE_LEVEL = 30  # unfinished uploads kept (all tenants)
TOP_UP_S, UPLOADS_PER_TOP_UP = 0.5, 4  # at most 8 uploads a second
HOLD_S = 1.5
# The claims of a scope started in [$1, $2): a lane pause holds the entry's stream's lane
# (the attempt row's) and the photo's own.
CLAIMS_SQL = f"""
SELECT extract(epoch FROM max(a.started_at))::float8 AS last, count(*) AS n
FROM photo_attempts a JOIN photos p ON p.id = a.photo_id
WHERE a.started_at >= to_timestamp($1) AND a.started_at < to_timestamp($2)
  AND a.outcome IN {CLAIMS}
  AND ($3::text IS NULL OR a.lane = $3 OR p.lane = $3) AND ($4::text IS NULL OR p.tenant = $4)
"""
NOW_SQL = "SELECT extract(epoch FROM clock_timestamp())::float8"


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.tag = tmp, f"pause{os.getpid()}"
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
            "DARKROOM_OPERATOR": "bench",
        }  # fmt: skip

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

    def heard(self) -> list[list[tuple[float, list[str]]]]:
        """Each worker's `pauses changed` lines: (time, the scopes in force)."""
        return [_heard(path) for path in sorted(self.tmp.glob("worker-*.log"))]


def _heard(path: Path) -> list[tuple[float, list[str]]]:
    lines = []
    for line in path.read_text().splitlines():
        if '"pauses changed"' in line:
            record = json.loads(line)
            at = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
            lines.append((at.timestamp(), record["paused"]))
    return lines


def label(scope: tuple[str | None, str | None]) -> str:
    return f"{scope[0] or '*'}/{'*' if scope[1] is None else scope[1]}"


class Load:
    """The steady backlog, topped up every TOP_UP_S: bulk rows for the feeder, and uploads
    XADDed as a producer does, each to its level of unfinished photos (a fixed rate would
    outgrow a loaded machine's capacity, and the drain with it)."""

    def __init__(self, pool: db.Pool, client: aioredis.Redis, rig: Rig) -> None:
        self.pool, self.client, self.stream = pool, client, f"{{{rig.tag}}}:photos"
        self.rng = random.Random(7)

    async def run(self) -> None:
        while True:
            for tenant in TENANTS:
                await self.top_up(tenant)
            await self.upload(INTERACTIVE_LEVEL - await self.left("interactive", None))
            await asyncio.sleep(TOP_UP_S)

    async def left(self, lane: str, tenant: str | None) -> int:
        count: int = await self.pool.fetchval(
            "SELECT count(*) FROM photos WHERE lane = $1 AND ($2::text IS NULL OR tenant = $2)"
            " AND processing_state IN ('uploaded', 'processing')", lane, tenant)  # fmt: skip
        return count

    async def top_up(self, tenant: str) -> None:
        await self.pool.execute(
            "INSERT INTO photos (id, original_key, lane, tenant, cost)"
            " SELECT gen_random_uuid(), $1, 'bulk', $2, 200000 FROM generate_series(1, $3)",
            ORIGINAL, tenant, max(0, BULK_LEVEL - await self.left("bulk", tenant)))  # fmt: skip

    async def upload(self, count: int) -> None:
        for _ in range(max(0, min(count, UPLOADS_PER_TOP_UP))):
            photo_id = uuid.uuid4()
            await self.pool.execute(
                "INSERT INTO photos (id, original_key, lane, tenant, cost, enqueued_at)"
                " VALUES ($1, $2, 'interactive', $3, 200000, now())",
                photo_id, ORIGINAL, self.rng.choice(TENANTS))  # fmt: skip
            await self.client.xadd(self.stream, task_fields(photo_id))  # type: ignore[arg-type]


def action(verb: str) -> audit.Action:
    return audit.Action(operator="bench", via="cli", action=verb, reason="bench")


async def window(
    pool: db.Pool, scope: tuple[str | None, str | None], since: float, seen: float, until: float
) -> dict[str, Any]:
    """The claims of `scope` in the second before `since` (its pause's start), from `since`
    to `until`, and from `seen` (a moment after the commit) to `until`."""
    before = await pool.fetchrow(CLAIMS_SQL, since - 1, since, *scope)
    after = await pool.fetchrow(CLAIMS_SQL, since, until, *scope)
    wrong = await pool.fetchrow(CLAIMS_SQL, seen, until, *scope)
    late = 0.0 if after["last"] is None else after["last"] - since
    return {"scope": label(scope), "since": since, "before": before["n"],
            "after": after["n"], "wrong": wrong["n"], "late_s": late}  # fmt: skip


async def effective(pool: db.Pool, count: int) -> list[dict[str, Any]]:
    """Part 1: pauses through the command's store call, each held HOLD_S, then resumed."""
    found = []
    for i in range(count):
        scope = SCOPES[i % len(SCOPES)]
        row = await pauses.pause(pool, action("pause"), scope, None)
        since, seen = row["since"].timestamp(), await pool.fetchval(NOW_SQL)
        await asyncio.sleep(max(0.0, since + HOLD_S - await pool.fetchval(NOW_SQL)))
        end = await pool.fetchval(NOW_SQL)
        await pauses.resume(pool, action("resume"), scope)
        found.append(await window(pool, scope, since, seen, end))
        await asyncio.sleep(0.5)
    return found


async def cycles(pool: db.Pool, count: int) -> tuple[list[dict[str, Any]], int]:
    """Part 2: quick cycles through the store calls; (the windows, the timed pauses)."""
    rng, found, timed = random.Random(29), [], 0
    for _ in range(count):
        scope = rng.choice(SCOPES)
        for_s = rng.uniform(0.2, 1.0) if rng.random() < 0.1 else None
        row = await pauses.pause(pool, action("pause"), scope, for_s)
        since, seen = row["since"].timestamp(), await pool.fetchval(NOW_SQL)
        if for_s is None:
            await asyncio.sleep(rng.uniform(0.05, 0.6))
            end = await pool.fetchval(NOW_SQL)
            await pauses.resume(pool, action("resume"), scope)
        else:
            timed += 1
            end = row["until"].timestamp()
            await asyncio.sleep(max(0.0, end - await pool.fetchval(NOW_SQL)))
        found.append(await window(pool, scope, since, seen, end))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
    return found, timed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def hearing(rig: Rig, found: list[dict[str, Any]]) -> list[float]:
    """For each pause, when the last of the workers heard of it (seconds after `since`)."""
    heard = rig.heard()
    waits = []
    for item in found:
        times = [next((t for t, now in lines if t >= item["since"] and item["scope"] in now),
                      None) for lines in heard]  # fmt: skip
        if all(t is not None for t in times):
            waits.append(max(times) - item["since"])  # type: ignore[type-var]
    return waits


async def measure(args: argparse.Namespace, rig: Rig) -> dict[str, Any]:
    pool = await db.connect(DATABASE_URL, 4)
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    target = rig.tmp / "storage" / ORIGINAL
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(PHOTO.read_bytes())
    load = Load(pool, client, rig)
    producer = asyncio.create_task(load.run())
    for _ in range(WORKERS):
        rig.worker()
    while not await pool.fetchval("SELECT count(*) FROM photo_jobs"):  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    await asyncio.sleep(5.0)  # warm: every worker past its self-check, the feeder feeding
    figures: dict[str, Any] = {"load_before": os.getloadavg()}
    started = time.monotonic()
    figures["effective"] = await effective(pool, args.pauses)
    figures["effective_s"] = time.monotonic() - started
    started = time.monotonic()
    figures["cycles"], figures["timed"] = await cycles(pool, args.cycles)
    figures["cycles_s"] = time.monotonic() - started
    figures["load_after"] = os.getloadavg()
    producer.cancel()
    await pauses.resume(pool, action("resume"), (None, None))
    figures["drain_s"] = await drain(pool)
    rig.stop_workers()
    figures["heard"] = hearing(rig, figures["effective"])
    figures["ledger"] = await ledger(pool, client, rig.tmp / "storage", rig.tag)
    await client.aclose()
    await pool.close()
    return figures


def report(f: dict[str, Any], args: argparse.Namespace) -> str:
    late = [w["late_s"] for w in f["effective"]]
    busy = sum(w["before"] > 0 for w in f["effective"])
    quick = [w["late_s"] for w in f["cycles"]]
    after = sum(w["after"] for w in f["effective"] + f["cycles"])
    wrong = sum(w["wrong"] for w in f["effective"] + f["cycles"])
    heard = f["heard"]
    ledger = f["ledger"]
    before, load = (", ".join(f"{x:.2f}" for x in f[k]) for k in ("load_before", "load_after"))
    lines = [
        "## Pause and resume under load (bench/pause.py)",
        "",
        f"Pause and resume under load ({machine().split('; load')[0]}; load average at the"
        f" start {before}, at the end of the cycles {load}):",
        f"{WORKERS} `darkroom run` workers (concurrency 2), tenants {', '.join(TENANTS)} with",
        f"{BULK_LEVEL} bulk photos each kept unfinished and up to {INTERACTIVE_LEVEL} uploads",
        f"(at most {UPLOADS_PER_TOP_UP / TOP_UP_S:g}/s; a 0.2 MP PNG each); scopes in turn: "
        + ", ".join(label(s) for s in SCOPES)
        + ".",
        "",
        "| figure | measured | target |",
        "|---|---:|---:|",
        f"| pauses (`darkroom pause`'s store call), each held {HOLD_S:g} s | {len(late)} "
        f"({busy} with claims of the scope in the second before) | 100 |",
        f"| last claim of the paused scope after the pause's start, p99 / max | "
        f"{pct(late, 0.99):.3f} / {max(late):.3f} s | ≤ 1 s (p99) |",
        f"| every worker heard of it (stops reading its lane), p50 / p99 / max | "
        f"{_spread(heard)} | — |",
        f"| pause/resume cycles through the store calls ({f['timed']} timed, ran out "
        f"by themselves) | {len(quick)} in {f['cycles_s']:.0f} s | 1,000 |",
        f"| last claim after the pause's start in those, p99 / max | "
        f"{pct(quick, 0.99):.3f} / {max(quick):.3f} s | ≤ 1 s |",
        f"| claims of a paused scope started after its pause's start (all pauses) | {after} | — |",
        f"| … started after its commit was seen (a clock read after it) | {wrong} | 0 |",
        f"| photos rendered | {ledger['photos']:,} | — |",
        f"| photos not published exactly once (lost, stuck or duplicated) | "
        f"{ledger['odd_n']} (stuck {ledger['stuck']}, twice {ledger['twice']}) | 0 |",
        f"| claims beyond one per photo | {ledger['extra_claims']} | 0 |",
        f"| entries left pending / dead letters | {ledger['pending']} / {ledger['dead']} | 0 / 0 |",
        f"| drain after the last resume | {f['drain_s']:.0f} s | — |",
    ]
    events = ", ".join(f"{k} {v}" for k, v in sorted(ledger["queue_events"].items()))
    lines += ["", f"Queue events: {events}.", "", NOTE]
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    median = statistics.median(values)
    return f"{median:.2f} / {pct(values, 0.99):.2f} / {max(values):.2f} s ({len(values)})"


NOTE = """\
A claim is a `photo_attempts` row a claim statement inserted (outcome running, published,
retrying, failed, released or worker_died); its `started_at` is the claim's transaction
start. A pause's `since` is its transaction's start, at or before its commit, so a claim
that began between the two (and read no pause) counts as late: the figure is an upper
bound. Photos are published exactly once when each has one `published` attempt, one claim,
`attempt` 1 on its job, one `darkroom.photo.published` event, and its storage folder holds
exactly the objects its row references. A paused tenant's interactive entry refused by the
claim waits `DARKROOM_CLAIM_IDLE_MS` (30 s) to be looked at again: the drain includes it."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pauses", type=int, default=100)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true", help="10 pauses, 40 cycles")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.pauses, args.cycles = 10, 40
    drop = ["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", DATABASE]
    subprocess.run(drop, check=True)
    asyncio.run(db.migrate(DATABASE_URL))
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp))
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
    if figures["ledger"]["odd"]:
        print("odd photos (first 10):", *figures["ledger"]["odd"], sep="\n", file=sys.stderr)
    if args.out:
        write_section(args.out, "pause", body)


if __name__ == "__main__":
    main()
