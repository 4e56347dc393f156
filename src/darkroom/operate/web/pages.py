"""Read-only pages and JSON: overview, photos, one photo, its images, dead letters,
/api/*, and the queue gauges on /metrics."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

import anyio
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from darkroom import metrics
from darkroom.errors import DarkroomError
from darkroom.operate import chart, history, ops
from darkroom.operate.finished import Finished
from darkroom.operate.web import downloads
from darkroom.operate.web.render import deps, json_response, render
from darkroom.queue.streams import Streams
from darkroom.store import db, probe, views
from darkroom.store.storage import CONTENT_TYPES

PAGE_SIZE = 50
LETTERS_PAGE_SIZE = 100
MAX_PAGE_SIZE = 500  # a larger `limit` is clamped to it, and the page shows the limit used
# A dead-letter page filtered by code reads at most this many letters (one XRANGE): the
# stream cannot be indexed by code, so the page says when it stopped short.
LETTER_SCAN_MAX = 1000
READY_TIMEOUT_S = 1.0  # each; both within the probe's timeoutSeconds (3)
STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


async def overview_data(
    pool: db.Pool, streams: Streams, finished: Finished | None = None
) -> dict[str, Any]:
    """The status and the throughput charts: what one snapshot holds (render.Deps).
    `finished`: the web process's kept minutes (None: the whole day is read)."""
    metrics.WEB_SNAPSHOTS.inc()
    report = await ops.status_report(pool, streams)
    per_minute, per_hour = await (finished or Finished()).charts(pool)
    report["throughput"] = {"per_minute": per_minute, "per_hour": per_hour}
    return report


async def overview(request: Request) -> Response:
    report = await deps(request).overview.get()
    charts = {
        "per_minute": chart.svg(report["throughput"]["per_minute"], "minute",
                                "Photos finished per minute, last hour"),
        "per_hour": chart.svg(report["throughput"]["per_hour"], "hour",
                              "Photos finished per hour, last day"),
    }  # fmt: skip
    settle_ms = int(deps(request).settings.web_snapshot_s * 1000) + 100  # refresh.js
    return render(
        request,
        "overview.html",
        report=report,
        charts=charts,
        settle_ms=settle_ms,
        q=request.query_params,
    )


async def api_status(request: Request) -> Response:
    return json_response(await deps(request).overview.get())


def parse_before(raw: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not raw:
        return None
    try:
        at, _, photo_id = raw.partition("_")
        return datetime.fromisoformat(at), uuid.UUID(photo_id)
    except ValueError:
        raise HTTPException(400, "bad page cursor") from None


def photo_filters(state: str | None, code: str | None) -> tuple[str | None, str | None]:
    if state is not None and state not in views.STATES:
        raise HTTPException(400, f"state must be one of {', '.join(views.STATES)}")
    if code is not None and state not in (None, "processing_failed"):
        raise HTTPException(400, "an error code filters failed photos: leave the state empty")
    return state, code


async def photo_page(request: Request) -> dict[str, Any]:
    """One keyset page of photos, newest first, and the cursor of the next (None: last)."""
    q = request.query_params
    state, code = photo_filters(q.get("state") or None, q.get("code") or None)
    size = page_size(q.get("limit"), PAGE_SIZE)
    rows = await views.page_photos(
        deps(request).pool, state, code, size + 1, parse_before(q.get("before"))
    )
    more, rows = len(rows) > size, rows[:size]
    cursor = f"{rows[-1]['updated_at'].isoformat()}_{rows[-1]['id']}" if more else None
    return {"photos": rows, "next": cursor, "limit": size, "state": state, "code": code}


async def photos(request: Request) -> Response:
    page = await photo_page(request)
    for row in page["photos"]:
        row["thumb"] = thumbnail_index(decode_renditions(row["renditions"]))
    return render(request, "photos.html", rows=page["photos"], state=page["state"],
                  code=page["code"], cursor=page["next"], states=views.STATES, limit=page["limit"],
                  max_limit=MAX_PAGE_SIZE)  # fmt: skip


async def api_photos(request: Request) -> Response:
    page = await photo_page(request)
    for row in page["photos"]:
        row["renditions"] = decode_renditions(row["renditions"])
    return json_response(page)


def page_size(raw: str | None, default: int) -> int:
    """`limit`: a positive integer, clamped to MAX_PAGE_SIZE."""
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise HTTPException(400, f"limit must be a whole number from 1 (at most {MAX_PAGE_SIZE})")
    return min(int(raw), MAX_PAGE_SIZE)


def decode_renditions(text: str | None) -> list[dict[str, Any]]:
    return msgspec.json.decode(text) if text else []


def thumbnail_index(renditions: list[dict[str, Any]]) -> int | None:
    """The smallest rendition, for list thumbnails."""
    if not renditions:
        return None
    return min(range(len(renditions)), key=lambda i: renditions[i].get("width") or 0)


async def photo_or_404(request: Request) -> dict[str, Any]:
    photo_id: uuid.UUID = request.path_params["photo_id"]
    row = await views.photo_detail(deps(request).pool, photo_id)
    if row is None:
        raise HTTPException(404, f"no photo {photo_id}")
    row["renditions"] = decode_renditions(row["renditions"])
    return row


async def report_or_404(request: Request) -> dict[str, Any]:
    """The photo, its facts and its attempt timeline (operate/history.py)."""
    photo_id: uuid.UUID = request.path_params["photo_id"]
    report = await history.photo_report(deps(request).pool, photo_id)
    if report is None:
        raise HTTPException(404, f"no photo {photo_id}")
    return report


async def photo(request: Request) -> Response:
    row = await report_or_404(request)
    return render(request, "photo.html", photo=row, q=request.query_params)


async def api_photo(request: Request) -> Response:
    row = await report_or_404(request)
    for index, rendition in enumerate(row["renditions"]):
        rendition["url"] = f"/photos/{row['id']}/renditions/{index}"
    return json_response(row)


async def rendition(request: Request) -> Response:
    row = await photo_or_404(request)
    index: int = request.path_params["index"]
    if index >= len(row["renditions"]):
        raise HTTPException(404, "no such rendition")
    item = row["renditions"][index]
    d = deps(request)
    opened = await downloads.stream_object(d.storage, d.downloads, item["key"], 1 << 30)
    content_type = CONTENT_TYPES.get(item.get("format", ""), "application/octet-stream")
    return downloads.object_response(*opened, content_type,
                                     {"cache-control": "private, max-age=60"})  # fmt: skip


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
    stream, first, done = await downloads.stream_object(
        d.storage, d.downloads, row["original_key"], d.settings.max_original_bytes
    )
    inline = sniff_inline(first)
    headers = {"cache-control": "no-store"}
    if inline is None:
        headers["content-disposition"] = "attachment"
    media_type = inline or "application/octet-stream"
    return downloads.object_response(stream, first, done, media_type, headers)


def letter_cursor(raw: str | None) -> str:
    if not raw:
        return "-"
    if not STREAM_ID.fullmatch(raw):
        raise HTTPException(400, "bad page cursor")
    return raw


async def letter_page(request: Request) -> tuple[ops.LetterPage, str | None, int]:
    q = request.query_params
    code = q.get("code") or None
    size = page_size(q.get("limit"), LETTERS_PAGE_SIZE)
    after = letter_cursor(q.get("after"))
    page = await ops.letter_page(deps(request).streams, code, after, size, LETTER_SCAN_MAX)
    return page, code, size


async def dead_letter_list(request: Request) -> Response:
    page, code, size = await letter_page(request)
    total = await deps(request).streams.dead_letter_count()
    return render(request, "dead_letters.html", letters=page.letters, page=page, code=code,
                  limit=size, total=total, q=request.query_params)  # fmt: skip


async def api_dead_letters(request: Request) -> Response:
    page, code, size = await letter_page(request)
    letters = [{"id": e.id, **e.fields} for e in page.letters]
    return json_response({"letters": letters, "next": page.after, "scanned": page.scanned,
                          "partial": page.partial, "limit": size, "code": code})  # fmt: skip


async def queue_metrics(request: Request) -> Response:
    report = await deps(request).overview.get()
    return Response(metrics.queue_metrics(report), media_type=CONTENT_TYPE_LATEST)


async def livez(request: Request) -> Response:
    return Response("ok\n", media_type="text/plain")


async def readyz(request: Request) -> Response:
    """200 while PostgreSQL and Redis answer (each within READY_TIMEOUT_S), else 503 naming
    what is down and why, as the worker's /readyz does: a load balancer sends no one to a
    page that can only show an error."""
    d = deps(request)
    checks = {"database": lambda: probe.ping(d.pool), "queue": d.streams.probe}
    down: dict[str, str] = {}
    for name, check in checks.items():
        try:
            with anyio.fail_after(READY_TIMEOUT_S):
                await check()
        except DarkroomError as exc:
            down[name] = f"{exc.reason}: {exc}"
        except TimeoutError:
            down[name] = f"timeout: no answer within {READY_TIMEOUT_S:g} s"
    body = {"ready": not down, "down": down}
    return Response(msgspec.json.encode(body) + b"\n", 503 if down else 200,
                    media_type="application/json")  # fmt: skip


async def favicon(request: Request) -> Response:
    return Response(status_code=204)
