"""PostgreSQL at its ceiling: the photo's path as N workers at full speed would drive it,
without rendering. Each of `slots` tasks takes an entry (XREADGROUP), claims it
(leases.claim, with the worker's lease and history row), publishes a fixed renditions
payload (publishing.publish), acks it (the ack script); the real events relay runs beside
them and sends every event before the run ends. Used by bench/capacity.py: the counters
and the sessions' CPU are read by the caller around `run`, on the dedicated database.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import anyio

from darkroom.duty import Duty
from darkroom.queue.eventstream import EventStream
from darkroom.queue.streams import Streams
from darkroom.queue.streams.connection import connect as redis_connect
from darkroom.relay import Relay
from darkroom.store import db, duties, intake, leases, publishing

FACTS = {"width": 64, "height": 48, "format": "png", "bytes": 120, "camera_make": None,
         "thumbhash": "3OcRJYB4d3h/iIeHeEh3eIhw+j2w", "dominant_color": "#336699"}  # fmt: skip
RENDITIONS = json.dumps([
    {"name": name, "key": f"renditions/x/{name}-1.webp", "format": "webp",
     "width": width, "height": width * 3 // 4, "bytes": 900}
    for name, width in (("thumb", 64), ("small", 64), ("medium", 64), ("large", 64))
])  # fmt: skip
LEASE = leases.Lease("ceiling", 60_000, 5)


def streams_of(client: Any, tag: str, consumer: str) -> Streams:
    return Streams(client, f"{{{tag}}}:photos", "ceiling", consumer, f"{{{tag}}}:dead")


async def prepare(database_url: str, redis_url: str, tag: str, photos: int) -> None:
    """The rows and their entries, as producers leave them (not measured)."""
    pool = await db.connect(database_url, 4)
    client = redis_connect(redis_url)
    try:
        streams = streams_of(client, tag, "producer")
        await streams.ensure_group()
        for _ in range(photos):
            photo_id = uuid.uuid4()
            await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
            await streams.enqueue({"photo_id": str(photo_id)})
    finally:
        await client.aclose()
        await pool.close()


async def _slot(pool: db.Pool, streams: Streams, done: list[float]) -> None:
    while entries := await streams.read_new(1, None):
        entry = entries[0]
        photo_id = uuid.UUID(entry.fields["photo_id"])
        claim = await leases.claim(pool, photo_id, entry.id, streams.consumer, LEASE,
                                   "interactive")  # fmt: skip
        if claim.outcome != "claimed":
            raise SystemExit(f"ceiling: {photo_id} {claim.outcome}")
        attempt = publishing.AttemptRow(claim.history_row, 0.0, 1.0, 0.0, 50.0)
        published = await publishing.publish(pool, photo_id, FACTS, RENDITIONS,
                                              (claim.token, entry.id), attempt)  # fmt: skip
        if published.status != "published":
            raise SystemExit(f"ceiling: {photo_id} {published.status}")
        await streams.ack(entry.id)
        done.append(time.monotonic())


async def drive(database_url: str, redis_url: str, tag: str, slots: int) -> float:
    """Every prepared entry through claim → publish → ack, the relay sending the events;
    photos/s from the first outcome to the last."""
    pool = await db.connect(database_url, slots + 2)
    client = redis_connect(redis_url)
    duty = Duty(duties.RELAY, pool, "ceiling", 10.0)  # one holder: each run takes it at once
    relay = Relay(duty, database_url, EventStream(client, f"{{{tag}}}:events", 1_000_000),
                  "darkroom://ceiling", keep_days=7)  # fmt: skip
    done: list[float] = []
    try:
        # the feeder's holder listens on the intake channel throughout, as in any worker pool
        async with (
            intake.listening(database_url, lambda _payload: None),
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(relay.run)
            for _ in range(3000):  # the duty, at once unless a former run's lease is left
                if relay.holding:
                    break
                await anyio.sleep(0.01)
            async with anyio.create_task_group() as workers:
                for i in range(slots):
                    workers.start_soon(_slot, pool, streams_of(client, tag, f"c{i}"), done)
            await relay.flush()  # every event sent and marked
            tg.cancel_scope.cancel()
    finally:
        await client.aclose()
        await pool.close()
    return (len(done) - 1) / (done[-1] - done[0])


def run(database_url: str, redis_url: str, tag: str, slots: int) -> float:
    return asyncio.run(drive(database_url, redis_url, tag, slots))


def setup(database_url: str, redis_url: str, tag: str, photos: int) -> None:
    asyncio.run(prepare(database_url, redis_url, tag, photos))


def measure(probe: Any, session_cpu: Any, database_url: str, redis_url: str, photos: int,
            slots: int) -> dict[str, Any]:  # fmt: skip
    """A short run (a quarter of `photos`) then the full one, each with new sessions: the
    steady state is their difference, as for the render-bound drains."""
    out: dict[str, Any] = {"slots": slots}
    for name, count in (("short", max(1, photos // 4)), ("full", photos)):
        tag = f"ceiling-{name}"
        setup(database_url, redis_url, tag, count)
        before, sessions = probe.read(), session_cpu()
        per_s = run(database_url, redis_url, tag, slots)
        cpu_s = sessions.stop()
        out[name] = {**probe.since(before), "pg_cpu_s": cpu_s, "per_s": per_s, "photos": count}
    return out


def _steady(full: dict[str, Any], short: dict[str, Any], key: str | None) -> float:
    def of(run: dict[str, Any]) -> float:
        return float(run["pg_cpu_s"] * 1000 if key is None else run["pg"][key])

    return (of(full) - of(short)) / (full["photos"] - short["photos"])


def table(drains: tuple[dict[str, Any], dict[str, Any]], ceiling: dict[str, Any]) -> str:
    """The render-bound drains (full, short; each with its "photos") beside the ceiling: per
    photo at steady state, and the rate."""
    lines = ["| run | photos/s | xact_commit per photo | tup_returned per photo | "
             "database CPU ms per photo |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    runs = (
        ("one worker rendering (`darkroom run --drain`)", *drains),
        (f"ceiling: {ceiling['slots']} tasks, no render", ceiling["full"], ceiling["short"]),
    )
    for name, full, few in runs:
        lines.append(f"| {name} | {full['per_s']:.0f} | {_steady(full, few, 'xact_commit'):.2f} "
                     f"| {_steady(full, few, 'tup_returned'):.1f} | "
                     f"{_steady(full, few, None):.2f} |")  # fmt: skip
    return "\n".join(lines)
