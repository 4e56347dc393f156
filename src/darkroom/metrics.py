"""Prometheus metrics and the health endpoints, behind one small adapter.

`/metrics` (Prometheus text), `/livez` (the event loop answers) and `/readyz` (the
worker is taking work) on DARKROOM_METRICS_PORT; 0 turns the server off.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

OUTCOMES = Counter("darkroom_entries_total", "Stream entries finished, by outcome", ["outcome"])
FAILURES = Counter("darkroom_failures_total", "Failed attempts, by error code", ["code", "final"])
STAGE_SECONDS = Histogram(
    "darkroom_stage_seconds",
    "Time spent per stage of one photo",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
RENDER_PEAK_RSS_MB = Histogram(
    "darkroom_render_peak_rss_mb",
    "Peak resident memory of one render process",
    buckets=(32, 64, 128, 256, 512, 1024, 2048, 4096),
)
OUTAGES = Counter("darkroom_outages_total", "Dependency outages seen", ["dependency"])
REQUEUED = Counter("darkroom_requeued_total", "Photos re-enqueued from Postgres", ["reason"])
IN_FLIGHT = Gauge("darkroom_in_flight", "Entries being processed by this worker")
RECLAIMED = Counter("darkroom_reclaimed_total", "Entries taken over with XAUTOCLAIM")
DELETED_WHILE_PENDING = Counter(
    "darkroom_deleted_while_pending_total", "Pending entries whose data was deleted"
)
SWEEP_SECONDS = Histogram(
    "darkroom_sweep_seconds",
    "Time of one full sweep pass over the stale unfinished photos",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300),
)
SWEEP_SCANNED = Counter("darkroom_sweep_scanned_total", "Stale unfinished photos read by the sweep")


Readiness = Callable[[], tuple[bool, dict[str, Any]]]


async def serve(port: int, ready: Readiness) -> asyncio.Server:
    """A minimal HTTP/1.0 responder; enough for Prometheus and container health checks."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            path = request.split(b" ")[1].decode() if request.count(b" ") >= 2 else "/"
            status, ctype, body = _route(path, ready)
            head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(respond, "0.0.0.0", port)


def _route(path: str, ready: Readiness) -> tuple[str, str, bytes]:
    if path.startswith("/metrics"):
        return "200 OK", CONTENT_TYPE_LATEST, generate_latest()
    if path.startswith("/livez"):
        return "200 OK", "text/plain", b"ok\n"
    if path.startswith("/readyz"):
        # 503 names what is wrong: {"down": {"queue": "read_only: ..."}, "stopping": false}
        ok, detail = ready()
        body = json.dumps(detail, sort_keys=True).encode() + b"\n"
        return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
    return "404 Not Found", "text/plain", b"not found\n"
