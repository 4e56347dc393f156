"""Bulk actions by query over many selected photos: is the count exact, what do the count,
the freeze and each batch cost, and what rate does a `bulk rerender` reach?

In its own database (DARKROOM_BENCH_DATABASE, default `darkroom_bench_bulk`, dropped after):
`--photos N` rows, of which `--selected` are one tenant's processed photos and the rest other
tenants and states. Measures `select` (exact count vs the seeded number), the freeze into
bulk_action_items, and a full `bulk rerender` (each photo its own transaction, handed to the
feeder), as wall time and as CPU seconds of this process and of the database backends
(the machine is shared: CPU seconds are the figure to compare).

    .venv/bin/python bench/bulk.py                          # 100,000 selected of 200,000
    .venv/bin/python bench/bulk.py --photos 4000 --selected 2000   # the smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import time
from typing import Any

import asyncpg
from pages import backends, cpu_s

from darkroom.operate import bulk
from darkroom.operate.progress import Progress
from darkroom.store import audit, db, selection
from darkroom.store.selection import Selection

PG = os.environ.get("DARKROOM_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
NAME = os.environ.get("DARKROOM_BENCH_DATABASE", "darkroom_bench_bulk")
SEED_SQL = """
INSERT INTO photos (id, original_key, tenant, processing_state, processed_at, renditions,
                    format, created_at, enqueued_at)
SELECT gen_random_uuid(), 'originals/x', CASE WHEN g <= $1 THEN 'acme' ELSE 't' || (g % 50) END,
       CASE WHEN g <= $1 OR g % 2 = 0 THEN 'processed' ELSE 'uploaded' END,
       CASE WHEN g <= $1 OR g % 2 = 0 THEN now() END,
       CASE WHEN g <= $1 OR g % 2 = 0 THEN '[]'::jsonb END, 'jpeg', now(), now()
FROM generate_series(1, $2) g
"""


async def measured(
    pool: db.Pool, admin: asyncpg.Connection, call: Any
) -> tuple[Any, dict[str, float]]:
    """The call's result, its wall seconds, and CPU seconds here and in the backends."""
    pids = await backends(admin, NAME)
    before, mine, wall = {p: cpu_s(p) for p in pids}, time.process_time(), time.monotonic()
    result = await call()
    after = {p: cpu_s(p) for p in await backends(admin, NAME)}
    spent = {"wall_s": time.monotonic() - wall, "client_cpu_s": time.process_time() - mine,
             "db_cpu_s": sum(s - before.get(p, 0.0) for p, s in after.items())}  # fmt: skip
    return result, {k: round(v, 3) for k, v in spent.items()}


async def main(args: argparse.Namespace) -> None:
    url = f"{PG}/{NAME}"
    admin = await asyncpg.connect(f"{PG}/postgres")
    await admin.execute(f'DROP DATABASE IF EXISTS "{NAME}" WITH (FORCE)')
    await db.migrate(url)
    pool = await db.connect(url, 2)
    try:
        await pool.execute(SEED_SQL, args.selected, args.photos)
        await pool.execute("ANALYZE photos")
        await report(pool, admin, args)
    finally:
        await pool.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{NAME}" WITH (FORCE)')
        await admin.close()


async def report(pool: db.Pool, admin: asyncpg.Connection, args: argparse.Namespace) -> None:
    where = Selection(tenant="acme", state="processed")
    n, counted = await measured(pool, admin, lambda: selection.count(pool, where))
    print(f"count: {n} of {args.selected} seeded (exact: {n == args.selected}) {counted}")
    plan = bulk.Plan("rerender", where, "bulk")
    run = bulk.Run(audit.Action(operator="bench", via="cli", action="bulk.rerender"), plan)
    (total, _), froze = await measured(pool, admin, lambda: bulk.begin(pool, run))
    print(f"freeze: {total} ids {froze}")
    progress = Progress(total, "re-render requested", io.StringIO())
    # a rerender through the bulk lane hands each photo to the feeder: no Redis call
    complete, acted = await measured(pool, admin, lambda: bulk.execute(pool, None, run, progress))  # type: ignore[arg-type]
    per_1000 = {k: round(v * 1000 / max(total, 1), 3) for k, v in acted.items()}
    rate = total / acted["wall_s"]
    print(f"rerender: complete={complete} rate={rate:.0f}/s {acted}; per 1,000: {per_1000}")
    generations = await pool.fetchval(
        "SELECT count(*) FROM photos WHERE rerender_generation = 1 AND tenant = 'acme'"
    )
    print(f"acted once: {generations} of {total} (every one: {generations == total})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=200_000)
    parser.add_argument("--selected", type=int, default=100_000)
    asyncio.run(main(parser.parse_args()))
