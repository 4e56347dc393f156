"""The lanes bench's feeding half: is the bulk lane work conserving?

For each photo size (a tiny PNG, a 480×360 JPEG, an 1800×1200 JPEG) and for one and three
workers (in this process, each with its own render processes, DARKROOM_CONCURRENCY 2):
  - single lane: the photos as interactive entries already in the stream (no feeder);
  - bulk lane: three tenants backlogged in PostgreSQL (8:1:1, every tenant backlogged to
    the end), fed by the feeder, with an upload (interactive) every UPLOAD_GAP_S.
Throughput is renders started per second from WARM_S after the workers' start to the end.
The uploads are the same photo as the backlog's, so the work-conserving figure is both
lanes' renders together against the single lane's: an upload's render uses a slot the
bulk lane would otherwise fill (bulk alone is shown too; with 1800×1200 photos the
uploads take about half the slots). "first bulk photo" is the first bulk photo processed,
counted from the workers' start.
bench/lanes.py runs it (`--feed-seconds`) and writes its table into the lanes section.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio
import pyvips
import redis.asyncio as aioredis

from darkroom import metrics
from darkroom.image import renderer
from darkroom.queue.messages import task_fields
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db
from darkroom.store.storage import FileStorage
from darkroom.worker import Worker

WARM_S = 1.0
UPLOAD_GAP_S = 0.5
# Generous renders per second per worker, to size a backlog no tenant finishes.
RATE_GUESS = {"tiny": 250, "medium": 120, "large": 25}
# A large photo renders in about a second on a loaded machine: longer runs, to count some.
LONGER = {"large": 2.0}
UNRESERVED: dict[str, object] = {"interactive_slots": 0}
ROWS_SQL = """
INSERT INTO photos (id, original_key, lane, tenant, cost, enqueued_at)
SELECT id, $2, $3, $4, $5, CASE WHEN $3 = 'interactive' THEN now() END
FROM unnest($1::uuid[]) AS t(id)
"""
CHUNK = 5_000
TENANTS = (("t-large", 8), ("t-small-1", 1), ("t-small-2", 1))


class Rig(Protocol):
    tmp: Path
    pool: db.Pool
    client: aioredis.Redis
    runs: int
    database_url: str

    def settings(self, tag: str, **extra: object) -> Settings: ...
    def streams(self, settings: Settings) -> Streams: ...
    async def original(self, path: Path) -> str: ...


@dataclass
class Photo:
    name: str
    key: str
    cost: int


@dataclass
class Starts:
    """When each render started, per lane (perf_counter), and the uploads' waits."""

    at: dict[str, list[float]] = field(default_factory=lambda: {"interactive": [], "bulk": []})
    waits: list[float] = field(default_factory=list)

    @contextmanager
    def recording(self) -> Iterator[None]:
        original = metrics.observe_queue_wait

        def observe(lane: str, enqueued_ms: int) -> float:
            wait_s = original(lane, enqueued_ms)
            self.at[lane].append(time.perf_counter())
            if lane == "interactive":
                self.waits.append(wait_s)
            return wait_s

        metrics.observe_queue_wait = observe  # type: ignore[assignment]
        try:
            yield
        finally:
            metrics.observe_queue_wait = original  # type: ignore[assignment]

    def rate(self, lane: str, started: float, seconds: float) -> float:
        counted = [t for t in self.at[lane] if started + WARM_S <= t <= started + seconds]
        return len(counted) / (seconds - WARM_S)


@dataclass
class Run:
    single: float = 0.0
    single_bulk_slots: float = 0.0  # the single lane without the reserved slot
    bulk: float = 0.0
    both: float = 0.0  # bulk and the uploads' renders together
    first_s: float = float("nan")
    first_start_s: float = float("nan")
    upload_max_s: float = float("nan")
    shares: dict[str, int] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)  # each round's both / single, same slots


NUMBERS = ("single", "single_bulk_slots", "bulk", "both", "first_s", "first_start_s",
           "upload_max_s")  # fmt: skip


async def feed_photos(rig: Rig, tiny: Path, corpus: list[Path]) -> list[Photo]:
    large = next((p for p in corpus if pyvips.Image.new_from_file(str(p)).width == 1800), None)
    source = large or corpus[0]
    medium = rig.tmp / "medium.jpg"
    pyvips.Image.thumbnail(str(source), 480, height=360, crop="centre").jpegsave(str(medium))
    made = []
    for name, path in (("tiny", tiny), ("medium", medium), ("large", source)):
        image = pyvips.Image.new_from_file(str(path))
        made.append(Photo(name, await rig.original(path), image.width * image.height))
    return made


async def add_rows(rig: Rig, photo: Photo, lane: str, tenant: str, count: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(count)]
    for start in range(0, count, CHUNK):
        chunk = ids[start : start + CHUNK]
        await rig.pool.execute(ROWS_SQL, chunk, photo.key, lane, tenant, photo.cost)
    return ids


async def xadd_all(rig: Rig, stream: str, ids: list[uuid.UUID]) -> None:
    for start in range(0, len(ids), CHUNK):
        async with rig.client.pipeline(transaction=False) as pipe:
            for photo_id in ids[start : start + CHUNK]:
                pipe.xadd(stream, task_fields(photo_id))
            await pipe.execute()


async def run_workers(
    rig: Rig, tag: str, workers: int, seconds: float, uploads: Photo | None, **extra: object
) -> tuple[Starts, float, float]:
    """`workers` workers for `seconds`; the starts, when they started (perf_counter and
    the database's clock, epoch seconds)."""
    starts = Starts()
    pools = [await db.connect(rig.database_url, 8) for _ in range(workers)]
    crew = []
    for i, pool in enumerate(pools):
        settings = rig.settings(tag, consumer=f"bench-feed-{i}", **extra)
        crew.append(Worker(settings, pool, rig.streams(settings), FileStorage(rig.tmp / "storage")))
    db_start = float(await rig.pool.fetchval("SELECT extract(epoch FROM clock_timestamp())"))
    started = time.perf_counter()
    with starts.recording():
        async with anyio.create_task_group() as tg:
            for worker in crew:
                tg.start_soon(worker.run)
            async with anyio.create_task_group() as producer:
                if uploads is not None:
                    producer.start_soon(upload_every, rig, crew[0].streams, uploads, UPLOAD_GAP_S)
                await anyio.sleep(seconds)
                producer.cancel_scope.cancel()
            for worker in crew:
                worker.stop()
    for pool in pools:
        await pool.close()
    return starts, started, db_start


async def upload_every(rig: Rig, streams: Streams, photo: Photo, gap_s: float) -> None:
    while True:
        await anyio.sleep(gap_s)
        [photo_id] = await add_rows(rig, photo, "interactive", "uploads", 1)
        await streams.enqueue(task_fields(photo_id))


async def clean(rig: Rig, settings: Settings) -> None:
    await rig.pool.execute("TRUNCATE photos CASCADE")
    streams = rig.streams(settings)
    await rig.client.delete(*streams.lane_streams.values(), streams.dead_stream)


async def single_lane(
    rig: Rig, photo: Photo, workers: int, seconds: float, **extra: object
) -> float:
    rig.runs += 1
    tag = f"bench-feed-{os.getpid()}-{rig.runs}"
    settings = rig.settings(tag, **extra)
    streams = rig.streams(settings)
    await streams.ensure_group()
    count = int(RATE_GUESS[photo.name] * workers * seconds)
    await xadd_all(rig, streams.stream, await add_rows(rig, photo, "interactive", "x", count))
    starts, started, _ = await run_workers(rig, tag, workers, seconds, None, **extra)
    await clean(rig, settings)
    return starts.rate("interactive", started, seconds)


async def bulk_lane(rig: Rig, photo: Photo, workers: int, seconds: float, run: Run) -> None:
    rig.runs += 1
    tag = f"bench-feed-{os.getpid()}-{rig.runs}"
    settings = rig.settings(tag)
    per_share = int(RATE_GUESS[photo.name] * workers * seconds)  # a small tenant's count
    for tenant, share in TENANTS:
        await add_rows(rig, photo, "bulk", tenant, per_share * share)
    starts, started, db_start = await run_workers(rig, tag, workers, seconds, photo)
    run.bulk = starts.rate("bulk", started, seconds)
    run.both = run.bulk + starts.rate("interactive", started, seconds)
    run.first_start_s = min(starts.at["bulk"], default=float("nan")) - started
    run.upload_max_s = max(starts.waits, default=float("nan"))
    first = await rig.pool.fetchval(
        "SELECT extract(epoch FROM min(updated_at)) FROM photos"
        " WHERE lane = 'bulk' AND processing_state = 'processed'"
    )
    run.first_s = float(first) - db_start if first is not None else float("nan")
    rows = await rig.pool.fetch(
        "SELECT tenant, count(*)::int AS n FROM photos WHERE lane = 'bulk'"
        " AND processing_state = 'processed' GROUP BY tenant"
    )
    run.shares = {r["tenant"]: r["n"] for r in rows}
    await clean(rig, settings)


async def measure(
    rig: Rig, made: list[Photo], seconds: float, rounds: int = 3
) -> dict[tuple[str, int], Run]:
    """Every run with the regular slots' processes at nice 0: on a machine shared with
    other work, a nice +5 process (the regular slots' beside a reserved one) loses CPU to
    it, and the single lane without a reserved slot would run un-niced: the comparison
    would measure the niceness, not the feeding."""
    renderer.REGULAR_NICE, nice = 0, renderer.REGULAR_NICE
    try:
        return await measure_all(rig, made, seconds, rounds)
    finally:
        renderer.REGULAR_NICE = nice


async def measure_all(
    rig: Rig, made: list[Photo], seconds: float, rounds: int
) -> dict[tuple[str, int], Run]:
    """Each photo size and worker count `rounds` times, the three runs in turns (single,
    single on bulk's slots, bulk; then the reverse): a shared machine's load moves within
    seconds, and one run of each compared one load with another. Each figure is the
    median of its rounds; `ratios` keeps each round's both / single, same slots."""
    runs = {}
    for photo in made:
        for workers in (1, 3):
            span, found = seconds * LONGER.get(photo.name, 1.0), []
            for i in range(rounds):
                found.append(await one_round(rig, photo, workers, span, reverse=i % 2 == 1))
            runs[(photo.name, workers)] = median_run(found)
    return runs


async def one_round(rig: Rig, photo: Photo, workers: int, span: float, reverse: bool) -> Run:
    run = Run()

    async def single() -> None:
        run.single = await single_lane(rig, photo, workers, span)

    async def unreserved() -> None:
        run.single_bulk_slots = await single_lane(rig, photo, workers, span, **UNRESERVED)

    async def bulk() -> None:
        await bulk_lane(rig, photo, workers, span, run)

    for step in (bulk, unreserved, single) if reverse else (single, unreserved, bulk):
        await step()
    return run


def median_run(found: list[Run]) -> Run:
    """The median of each figure over the rounds; the tenants' shares summed."""
    middle = Run(**{name: statistics.median(getattr(r, name) for r in found)
                    for name in NUMBERS})  # fmt: skip
    for r in found:
        for tenant, n in r.shares.items():
            middle.shares[tenant] = middle.shares.get(tenant, 0) + n
        middle.ratios.append(r.both / r.single_bulk_slots if r.single_bulk_slots else 0.0)
    return middle


def feed_table(runs: dict[tuple[str, int], Run]) -> str:
    lines = [
        "| photos | workers | single lane (photos/s) | single lane, bulk's slots (photos/s) "
        "| bulk lane + uploads (photos/s) | of which bulk | both lanes / single "
        "| bulk alone / single | both / single, same slots "
        "| first bulk photo started, done (s) | upload wait max (s) | bulk done by tenant |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, workers), r in runs.items():
        ratio = r.both / r.single if r.single else float("nan")
        alone = r.bulk / r.single if r.single else float("nan")
        same = r.both / r.single_bulk_slots if r.single_bulk_slots else float("nan")
        shares = " / ".join(str(r.shares.get(t, 0)) for t, _ in TENANTS)
        rounds = ", ".join(f"{x:.2f}" for x in r.ratios)
        lines.append(f"| {name} | {workers} | {r.single:.1f} | {r.single_bulk_slots:.1f} "
                     f"| {r.both:.1f} | {r.bulk:.1f} | {ratio:.2f} × | {alone:.2f} × "
                     f"| {same:.2f} × ({rounds}) "
                     f"| {r.first_start_s:.2f}, {r.first_s:.2f} "
                     f"| {r.upload_max_s:.2f} | {shares} |")  # fmt: skip
    return "\n".join(lines)
