"""What the interleaving test (tests/test_interleavings.py) checks, as reads of PostgreSQL,
Redis and storage and of the harness's ledger: after every step, and once the faults have
stopped and the queue is drained (docs/reliability.md, "The interleaving test")."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio

from darkroom.queue.streams import Streams
from darkroom.store import db, intake
from tests.interleave import Ledger

FINAL_EVENTS = ("darkroom.photo.published", "darkroom.photo.rerendered",
                "darkroom.photo.failed", "darkroom.photo.rerender_failed",
                "darkroom.photo.upgraded")  # fmt: skip


class AwaitingFix(AssertionError):
    """A broken promise that the fixes of fencing tokens, re-render generations and
    derived in-flight counts keep; expected to fail until they are merged."""


class Broken(AssertionError):
    """A broken promise that no pending fix explains: a real failure."""


@dataclass
class World:
    """What the checks read: the database, Redis, the storage folder, the ledger."""

    pool: db.Pool
    client: redis.asyncio.Redis
    root: Path
    ledger: Ledger
    streams: Streams


async def after_every_step(world: World) -> None:
    await renditions_stored(world)
    if world.ledger.wrong:
        raise AwaitingFix("; ".join(world.ledger.wrong))
    await one_event_per_finish(world)
    await no_stalled_tenant(world)


async def renditions_stored(world: World) -> None:
    """Every row's renditions exist with the bytes the row describes (the harness's
    storage also records a delete of a key a row references: `ledger.wrong`)."""
    for row in await world.pool.fetch(RENDITIONS_SQL):
        for r in msgspec.json.decode(row["renditions"]):
            path = world.root / r["key"]
            size = path.stat().st_size if path.exists() else None
            if size != r["bytes"]:
                found = "missing" if size is None else f"{size} bytes"
                raise AwaitingFix(f"{row['id']} names {r['key']} ({r['bytes']} bytes): {found}")


async def one_event_per_finish(world: World) -> None:
    """Each accepted finishing write committed one final event, and no other did."""
    counted = {r["photo_id"]: r["n"] for r in await world.pool.fetch(EVENTS_SQL)}
    expected = {p: len(f) for p, f in world.ledger.finished.items() if f}
    if counted != expected:
        raise Broken(f"final events {counted} != accepted finishing writes {expected}")


async def no_stalled_tenant(world: World) -> None:
    """The feeder never counts a tenant's photo in flight that nothing will finish: no
    live lease holds it and no entry for it is left in either stream. (At most, not
    equal: an entry fed and not yet read holds no lease, yet is the tenant's work.) Either
    stream: a bulk re-render moves a photo into the bulk lane while its interactive entry
    holds the job; the feeder's entry, whose claim answers `busy`, is acked as a duplicate,
    and the interactive entry, pending, takes the job on (reclaimed if its worker stalls)."""
    async with world.pool.acquire() as conn:
        counted = await intake.in_flight(conn)
    queued: list[uuid.UUID] = []
    for lane in ("bulk", "interactive"):
        raw: Any = await world.client.xrange(world.streams.for_lane(lane).stream)
        queued += [uuid.UUID(_text(dict(zip(f[::2], f[1::2], strict=True))["photo_id"]))
                   for _, f in raw]  # fmt: skip
    rows = await world.pool.fetch(OUTSTANDING_SQL, queued)
    outstanding = {r["tenant"]: r["n"] for r in rows}
    over = {t: n for t, n in counted.items() if n > outstanding.get(t, 0)}
    if over:
        raise AwaitingFix(f"in flight {counted}, outstanding {outstanding}: stalled {over}")


async def after_the_drain(world: World, photos: list[uuid.UUID]) -> None:
    """Every photo final, every request honoured, no tenant in flight, and nothing left
    that would keep `run --drain` from ending."""
    rows = {r["id"]: r for r in await world.pool.fetch(FINAL_SQL)}
    for photo_id in photos:
        row = rows[photo_id]
        if row["processing_state"] == "erased":
            continue  # final: its requests end with it (tests/interleave_erase.py)
        if row["processing_state"] not in ("processed", "processing_failed"):
            raise AwaitingFix(f"{photo_id} stays {row['processing_state']} after the drain")
        if row["rerender_requested_at"] is not None and row["job_state"] != "failed":
            raise AwaitingFix(f"{photo_id}: re-render still requested after the drain")
        honoured(world.ledger, photo_id)
    async with world.pool.acquire() as conn:
        if counted := await intake.in_flight(conn):
            raise AwaitingFix(f"tenants stay in flight after the drain: {counted}")
    if await world.streams.pending_count() or await intake.has_unfed(world.pool, True):
        raise Broken("the drain would not end: entries pending or photos unfed")


def honoured(ledger: Ledger, photo_id: uuid.UUID) -> None:
    """The last request (insert, re-render, retry, replay) led to a render that started
    after it and finished (published, or failed for good)."""
    asked = ledger.requested.get(photo_id, 0)
    # an upgrade answers no request: it adds to the render before it (tests/interleave_upgrade.py)
    started = [ledger.granted_at.get(g or 0, 0) for g, call in ledger.finished.get(photo_id, [])
               if call != "publish_upgrade"]  # fmt: skip
    if not any(at > asked for at in started):
        raise AwaitingFix(f"{photo_id}: the request at t={asked} was never rendered "
                          f"(finished renders started at {started})")  # fmt: skip


def _text(value: bytes | str) -> str:
    """A field of a raw read (XRANGE answers raw on a client Streams configured)."""
    return value.decode() if isinstance(value, bytes) else value


RENDITIONS_SQL = (
    "SELECT id, renditions::text AS renditions FROM photos WHERE renditions IS NOT NULL"
)
EVENTS_SQL = f"""
SELECT photo_id, count(*)::int AS n FROM photo_events
WHERE type IN ({", ".join(f"'{t}'" for t in FINAL_EVENTS)}) GROUP BY photo_id
"""
# Bulk photos with work outstanding: a live lease holds the job, or an entry (of either
# stream) waits for it.
OUTSTANDING_SQL = """
SELECT p.tenant, count(*)::int AS n FROM photos p
LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE p.lane = 'bulk'
  AND (p.id = ANY($1::uuid[]) OR (j.state = 'active' AND j.lease_until > now()))
GROUP BY p.tenant
"""
FINAL_SQL = """
SELECT p.id, p.processing_state, p.rerender_requested_at, j.state AS job_state
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
"""
