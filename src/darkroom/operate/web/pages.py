"""Read-only pages and JSON: overview, photos, one photo, its images, dead letters,
/api/*, and the queue gauges on /metrics."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from darkroom import metrics
from darkroom.errors import OriginalMissingError, OriginalTooLargeError
from darkroom.operate import chart, ops
from darkroom.operate.web.render import Deps, deps, json_response, render
from darkroom.store import db
from darkroom.store.storage import CONTENT_TYPES, Storage

PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
STATES = ("uploaded", "processing", "processed", "processing_failed")


async def overview_data(d: Deps) -> dict[str, Any]:
    report = await ops.status_report(d.pool, d.streams)
    now, minutes = await db.throughput(d.pool, "minute", 3600)
    _, hours = await db.throughput(d.pool, "hour", 86400)
    report["throughput"] = {
        "per_minute": chart.fill(now, minutes, "minute", 60),
        "per_hour": chart.fill(now, hours, "hour", 24),
    }
    return report


async def overview(request: Request) -> Response:
    report = await overview_data(deps(request))
    charts = {
        "per_minute": chart.svg(report["throughput"]["per_minute"], "minute",
                                "Photos finished per minute, last hour"),
        "per_hour": chart.svg(report["throughput"]["per_hour"], "hour",
                              "Photos finished per hour, last day"),
    }  # fmt: skip
    return render(request, "overview.html", report=report, charts=charts)


async def api_status(request: Request) -> Response:
    return json_response(await overview_data(deps(request)))


def parse_before(raw: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not raw:
        return None
    try:
        at, _, photo_id = raw.partition("_")
        return datetime.fromisoformat(at), uuid.UUID(photo_id)
    except ValueError:
        raise HTTPException(400, "bad page cursor") from None


async def photos(request: Request) -> Response:
    q = request.query_params
    state = q.get("state") or None
    if state is not None and state not in STATES:
        raise HTTPException(400, f"state must be one of {', '.join(STATES)}")
    code = q.get("code") or None
    size = page_size(q.get("limit"))
    rows = await db.page_photos(
        deps(request).pool, state, code, size + 1, parse_before(q.get("before"))
    )
    more, rows = len(rows) > size, rows[:size]
    for row in rows:
        row["thumb"] = thumbnail_index(decode_renditions(row["renditions"]))
    cursor = f"{rows[-1]['updated_at'].isoformat()}_{rows[-1]['id']}" if more else None
    return render(request, "photos.html", rows=rows, state=state, code=code, cursor=cursor,
                  states=STATES, limit=size)  # fmt: skip


def page_size(raw: str | None) -> int:
    if not raw:
        return PAGE_SIZE
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE_SIZE:
        raise HTTPException(400, f"limit must be 1..{MAX_PAGE_SIZE}")
    return int(raw)


def decode_renditions(text: str | None) -> list[dict[str, Any]]:
    return msgspec.json.decode(text) if text else []


def thumbnail_index(renditions: list[dict[str, Any]]) -> int | None:
    """The smallest rendition, for list thumbnails."""
    if not renditions:
        return None
    return min(range(len(renditions)), key=lambda i: renditions[i].get("width") or 0)


async def photo_or_404(request: Request) -> dict[str, Any]:
    photo_id: uuid.UUID = request.path_params["photo_id"]
    row = await db.photo_detail(deps(request).pool, photo_id)
    if row is None:
        raise HTTPException(404, f"no photo {photo_id}")
    row["renditions"] = decode_renditions(row["renditions"])
    return row


async def photo(request: Request) -> Response:
    row = await photo_or_404(request)
    return render(request, "photo.html", photo=row, q=request.query_params)


async def api_photo(request: Request) -> Response:
    row = await photo_or_404(request)
    for index, rendition in enumerate(row["renditions"]):
        rendition["url"] = f"/photos/{row['id']}/renditions/{index}"
    return json_response(row)


async def rendition(request: Request) -> Response:
    row = await photo_or_404(request)
    index: int = request.path_params["index"]
    if index >= len(row["renditions"]):
        raise HTTPException(404, "no such rendition")
    item = row["renditions"][index]
    data = await fetch(deps(request).storage, item["key"], 1 << 30)
    content_type = CONTENT_TYPES.get(item.get("format", ""), "application/octet-stream")
    return Response(data, media_type=content_type,
                    headers={"cache-control": "private, max-age=60"})  # fmt: skip


async def fetch(storage: Storage, key: str, max_bytes: int) -> bytes:
    """An object from storage; a missing or oversized one is the photo's problem (404/413),
    not an outage (503)."""
    try:
        return await storage.get(key, max_bytes)
    except OriginalMissingError as exc:
        raise HTTPException(404, f"{exc.code}: {exc}") from None
    except OriginalTooLargeError as exc:
        raise HTTPException(413, f"{exc.code}: {exc}") from None


# Raster types a browser shows safely; anything else (HEIC, AVIF, unknown) is a download,
# never rendered inline from the page's origin.
MAGIC = ((b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG\r\n\x1a\n", "image/png"),
         (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))  # fmt: skip


def sniff_inline(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((ctype for magic, ctype in MAGIC if data.startswith(magic)), None)


async def original(request: Request) -> Response:
    row = await photo_or_404(request)
    d = deps(request)
    data = await fetch(d.storage, row["original_key"], d.settings.max_original_bytes)
    inline = sniff_inline(data)
    headers = {"cache-control": "no-store"}
    if inline is None:
        headers["content-disposition"] = "attachment"
    return Response(data, media_type=inline or "application/octet-stream", headers=headers)


async def dead_letter_list(request: Request) -> Response:
    code = request.query_params.get("code") or None
    d = deps(request)
    letters = [e async for e in ops.dead_letters(d.streams, [code] if code else None, 500)]
    status = await d.streams.status()
    return render(request, "dead_letters.html", letters=letters, code=code,
                  total=status["dead_letters"], q=request.query_params)  # fmt: skip


async def queue_metrics(request: Request) -> Response:
    report = await ops.status_report(deps(request).pool, deps(request).streams)
    return Response(metrics.queue_metrics(report), media_type=CONTENT_TYPE_LATEST)


async def livez(request: Request) -> Response:
    return Response("ok\n", media_type="text/plain")


async def favicon(request: Request) -> Response:
    return Response(status_code=204)
