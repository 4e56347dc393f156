"""Deferred renditions: which renditions a delivery renders, the upgrade's entry in the bulk
lane after an interactive photo's first publish, and the upgrade's own fenced publish.

An interactive photo publishes with its fast renditions; the heavy ones (AVIF, `:defer`)
cost more than the rest of its render (bench/avif.py), so a bulk entry renders them later
and adds them to the manifest with a `darkroom.photo.upgraded` event (docs/photos.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
import structlog

from darkroom.duty import Tenure
from darkroom.errors import DarkroomError
from darkroom.queue.messages import Entry, task_fields
from darkroom.queue.streams import Streams
from darkroom.recorder import Recorder
from darkroom.settings import RenditionSpec, Settings, split
from darkroom.store import db, keys, leases, upgrading

log = structlog.get_logger("darkroom.upgrades")

Delete = Callable[[uuid.UUID, list[str], str], Awaitable[None]]
Again = Callable[[Entry, uuid.UUID, str | None], Awaitable[None]]
LOST_BATCH = 500


def specs_for(settings: Settings, lane: str, upgrade: bool) -> tuple[list[RenditionSpec], bool]:
    """What this delivery renders, and whether it leaves renditions for an upgrade: an
    upgrade the deferred ones, an interactive render the others, a bulk render all."""
    fast, deferred = split(settings.renditions)
    if upgrade:
        return deferred, False
    if lane == "interactive" and deferred:
        return fast, True
    return list(settings.renditions), False


@dataclass
class Upgrades:
    """The worker's side of upgrades: its pool, streams and history recorder."""

    pool: db.Pool
    streams: Streams
    recorder: Recorder

    async def request(self, entry: Entry, photo_id: uuid.UUID) -> None:
        """After the publish that deferred renditions committed: the upgrade's entry in the
        bulk stream (before it, the entry could find the render's own live lease, `busy`,
        and be acked as a duplicate). Best effort: a failure is logged, the photo keeps its
        published renditions and its request (docs/photos.md, what is left)."""
        fields = task_fields(photo_id, entry.fields)
        try:
            entry_id = await self.streams.for_lane("bulk").enqueue(fields)
        except DarkroomError as exc:  # the publish stands whatever Redis says
            log.warning("upgrade not enqueued", photo_id=str(photo_id), error=str(exc))
            return
        log.info("upgrade enqueued", photo_id=str(photo_id), entry_id=entry_id)

    async def publish(
        self,
        entry: Entry,
        claim: leases.Claim,
        renditions: list[dict[str, Any]],
        delete: Delete,
        again: Again,
    ) -> str:
        """The upgrade's fenced publish; its outcome. A refused one deletes this delivery's
        uploads (no lease of it can name them any more); a re-render requested meanwhile
        goes through the photo's own lane."""
        upgraded = await upgrading.publish_upgrade(
            self.pool, claim.photo_id, msgspec.json.encode(renditions).decode(),
            (claim.token, entry.id), self.recorder.publishing(entry),
        )  # fmt: skip
        current = [r["key"] for r in renditions]
        if upgraded.status != "upgraded":
            if upgraded.status != "lost":
                await delete(claim.photo_id, current, "refused upgrade")
            log.warning("lease_lost", entry_id=entry.id, photo_id=str(claim.photo_id),
                        token=claim.token, refused="upgrade", status=upgraded.status)  # fmt: skip
            return {"lost": "lease_lost", "erased": "skipped"}.get(upgraded.status, "already")
        self.recorder.published(entry)
        await delete(claim.photo_id, keys.superseded(upgraded.replaced, current), "superseded")
        if upgraded.again:
            await again(entry, claim.photo_id, upgraded.lane)
        return "upgraded"


async def requeue_lost(
    pool: db.Pool, bulk: Streams, before: datetime, tenure: Tenure, margin_ms: int
) -> list[uuid.UUID]:
    """The sweep's: an upgrade whose entry never reached the bulk stream gets one, with
    the photo's trace context (a spare entry, should the judgement be wrong, is `busy` or
    `already` at its claim). A refused take (the sweep's duty moved on) ends the duty."""
    oldest = await bulk.oldest_entry_ms()
    lost = await upgrading.take_lost(pool, before, oldest, margin_ms, tenure.fence, LOST_BATCH)
    if lost is None:
        tenure.lose("write_refused")
        return []
    for photo_id, traceparent in lost.items():
        await bulk.enqueue(task_fields(photo_id, {"traceparent": traceparent}))
    if lost:
        log.warning("lost upgrades enqueued again", photos=len(lost))
    return list(lost)
