"""Postgres is the source of truth: re-enqueue the unfinished photos that Redis lost.

A photo is lost when it is still `uploaded`/`processing`, shows no progress for
DARKROOM_SWEEP_AFTER_S, and its entry is provably gone from the work stream: the entry
its job last went through is missing, or (never delivered) every entry still in the
stream is newer than the photo's last activity. That covers a Redis restart without
persistence, a producer that crashed between INSERT and XADD, and entries deleted while
pending. Each photo is judged against its own lane's stream and goes back to its lane: an
interactive one by XADD, a bulk one to the feeder (`enqueued_at = NULL`; one the feeder
has not fed yet is not lost). One worker sweeps at a time: the holder of the sweep's leased
duty (duty.py), whose every requeue first takes the photo under the duty's fence. An
upgrade whose entry was lost (upgrades.py) goes back into the bulk stream the same way.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from darkroom import metrics, upgrades
from darkroom.duty import Duty, Tenure, process_holder
from darkroom.queue.messages import task_fields
from darkroom.queue.streams import Streams
from darkroom.store import db, duties, intake
from darkroom.store import lanes as store_lanes

BATCH = 500
# The lease of a pass run outside a worker (a test, a tool): the worker passes its own duty.
ONE_OFF_LEASE_S = 10.0
# Tolerated clock difference between the Redis and PostgreSQL hosts.
CLOCK_MARGIN_MS = 5_000


def is_lost(photo: dict[str, Any], oldest_entry_ms: int | None, missing: set[str]) -> bool:
    """Pure: is this stale photo's stream entry certainly gone?"""
    entry = photo["stream_entry"]
    if entry is not None:
        return bool(entry in missing)
    return oldest_entry_ms is None or oldest_entry_ms > photo["last_activity_ms"] + CLOCK_MARGIN_MS


def is_in_stream_of(photo: dict[str, Any], lane: str) -> bool:
    """Pure: is this stale photo's entry to be looked for in `lane`'s stream? A bulk photo
    not fed yet (`enqueued_at` NULL) is in none: it waits for the feeder, it is not lost."""
    return bool(photo["lane"] == lane and not (lane == "bulk" and photo["unfed"]))


async def sweep(
    pool: db.Pool, streams: Streams, after_s: float, duty: Duty | None = None
) -> list[uuid.UUID]:
    """One full pass as the holder of the sweep's duty; returns the photos re-enqueued
    (none if another worker holds it; those before the loss if this one loses it). Each
    re-enqueue commits on its own: a sweeper killed half-way leaves at most one photo
    enqueued twice."""
    duty = duty or Duty(duties.SWEEP, pool, process_holder("sweep"), ONE_OFF_LEASE_S)
    lost: list[uuid.UUID] = []
    async with duty.hold() as tenure:
        if tenure is None:
            return []
        with metrics.SWEEP_SECONDS.time():
            before = await db.sweep_horizon(pool, after_s)
            await _pass(pool, streams, before, tenure, lost)
            if tenure.live():
                lost += await upgrades.requeue_lost(
                    pool, streams.for_lane("bulk"), before, tenure, CLOCK_MARGIN_MS
                )
    return lost


async def _pass(
    pool: db.Pool, streams: Streams, before: datetime, tenure: Tenure, lost: list[uuid.UUID]
) -> None:
    """Keyset pages over (last_activity_at, id) below a horizon fixed at the start: each
    stale photo is read once. A photo touched during the pass (by this sweep or a worker)
    moves past the horizon (DARKROOM_SWEEP_AFTER_S > 0), so it is not read again."""
    page = db.FIRST_PAGE
    while tenure.live() and (stale := await db.stale_photos(pool, before, BATCH, page)):
        metrics.SWEEP_SCANNED.inc(len(stale))
        for view in streams.lanes():
            mine = [p for p in stale if is_in_stream_of(p, view.lane)]
            if mine:
                lost += await _requeue_lost_of(pool, view, mine, before, tenure)
        page = (stale[-1]["last_activity_at"], stale[-1]["id"])


async def _requeue_lost_of(
    pool: db.Pool, view: Streams, stale: list[dict[str, Any]], before: datetime, tenure: Tenure
) -> list[uuid.UUID]:
    """The lost photos of one lane, judged against that lane's stream; each taken under
    the duty's fence first (a sweep that lost its duty stops before its XADD)."""
    oldest = await view.oldest_entry_ms()
    missing = await view.missing([p["stream_entry"] for p in stale if p["stream_entry"]])
    lost: list[uuid.UUID] = []
    for photo_id in (p["id"] for p in stale if is_lost(p, oldest, missing)):
        taken = await store_lanes.take_lost(pool, photo_id, before, tenure.fence)
        if taken == "refused":
            tenure.lose("write_refused")
            break
        if taken == "taken":
            await requeue(pool, view, photo_id)
            lost.append(photo_id)
    return lost


async def requeue(conn: db.Pool | db.Connection, view: Streams, photo_id: uuid.UUID) -> None:
    """Back into `view`'s lane: XADD (interactive), or to the feeder (bulk). The job row is
    committed before the XADD: a worker that reads the entry at once must find it to lock,
    or its claim (whose snapshot predates the row) answers `busy` and the entry waits
    DARKROOM_CLAIM_IDLE_MS."""
    if view.lane == "bulk":
        await store_lanes.to_feeder(conn, photo_id)
        return
    traced = await intake.prepare_jobs(conn, [photo_id])
    entry_id = await view.enqueue(task_fields(photo_id, {"traceparent": traced.get(photo_id, "")}))
    await db.record_requeued(conn, photo_id, entry_id)


async def requeue_deleted(pool: db.Pool, view: Streams, entry_ids: list[str]) -> list[uuid.UUID]:
    """Pending entries deleted from `view`'s stream (XAUTOCLAIM's third element): enqueue
    their photos again, in that lane."""
    photos = await db.photos_of_entries(pool, entry_ids)
    for photo_id in photos:
        await requeue(pool, view, photo_id)
    return photos
