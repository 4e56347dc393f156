"""Prometheus metrics and the health endpoints, behind one small adapter.

`/metrics` (Prometheus text, or OpenMetrics with exemplars when the scraper asks), `/livez`
(the event loop answers) and `/readyz` (the worker is taking work) on DARKROOM_METRICS_PORT;
0 turns the server off.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import choose_encoder

OUTCOMES = Counter("darkroom_entries_total", "Stream entries finished, by outcome", ["outcome"])
FAILURES = Counter("darkroom_failures_total", "Failed attempts, by error code", ["code", "final"])
TRANSIENT_WAITS = Counter(
    "darkroom_transient_waits_total",
    "Waits in place after a transient error of a dependency that answered its probe",
    ["code", "reason"],
)
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
RENDER_BUDGET_MB = Gauge(
    "darkroom_render_budget_mb", "Estimated decode memory the render slots share (the budget)"
)
RENDER_BUDGET_IN_USE_MB = Gauge(
    "darkroom_render_budget_in_use_mb", "Estimated decode memory of the renders running now"
)
RENDER_BUDGET_WAIT_SECONDS = Histogram(
    "darkroom_render_budget_wait_seconds",
    "Waits of a photo holding its render slot until its decode memory fit the budget",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
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
# photo events: the relay of this worker, if it holds the lock
EVENTS_RELAYED = Counter("darkroom_events_relayed_total", "Photo events XADDed (a resend too)")
EVENTS_LAG_SECONDS = Histogram(
    "darkroom_events_lag_seconds",
    "From an event's transaction start (PostgreSQL's clock) to its XADD (the worker's)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
EVENTS_RELAY = Gauge("darkroom_events_relay", "1 while this worker relays photo events")
# leased duties (duty.py): a label per duty, a handful of series
DUTY_HELD = Gauge("darkroom_duty_held", "1 while this worker holds the duty's lease", ["duty"])
DUTY_LOST = Counter(
    "darkroom_duty_lost_total",
    "Leases this worker lost while holding (refused or unrenewed)",
    ["duty"],
)

# ---- lanes ----
QUEUE_WAIT_SECONDS = Histogram(
    "darkroom_queue_wait_seconds",
    "From a first delivery's XADD (its entry id) to its render start, by lane",
    ["lane"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600),
)


def watch_render_budget(budget: Any) -> None:
    """The render pool's memory budget (image/budget.py, which imports no metrics library)
    reports its use and its waits here."""
    RENDER_BUDGET_MB.set(budget.total_mb)
    budget.on_use = RENDER_BUDGET_IN_USE_MB.set
    budget.on_wait = lambda wait_s: observe(RENDER_BUDGET_WAIT_SECONDS, wait_s)


# What gives an observation its exemplar: darkroom.tracing installs it when it starts (this
# module sits below it, so it is told rather than asks); None while tracing is off.
_exemplar: Callable[[], dict[str, str] | None] | None = None


def exemplars_from(source: Callable[[], dict[str, str] | None]) -> None:
    global _exemplar
    _exemplar = source


# When each histogram bucket last got an exemplar. A scrape shows a bucket's latest exemplar
# only, and scrapers come every few seconds at most, so an observation whose bucket got one
# within EXEMPLAR_EVERY_S sets none (one costs a traced delivery about 5 µs of CPU an
# observation, most of it prometheus_client's checks of the labels).
EXEMPLAR_EVERY_S = 1.0
_exemplified: dict[tuple[int, int], float] = {}
_now = time.monotonic


def observe(histogram: Histogram, value: float) -> None:
    """An observation with the current span's ids as its exemplar when tracing is on, unless
    its bucket got one within EXEMPLAR_EVERY_S."""
    if _exemplar is None or value != value:  # NaN falls in no bucket: nothing to exemplify
        histogram.observe(value)
        return
    bucket, now = _bucket(histogram, value), _now()
    if bucket is not None and now - _exemplified.get(bucket, -math.inf) < EXEMPLAR_EVERY_S:
        histogram.observe(value)
        return
    labels = _exemplar()
    if labels is not None and bucket is not None:  # outside a sampled span: a later one may
        _exemplified[bucket] = now
    histogram.observe(value, labels)


def _bucket(histogram: Histogram, value: float) -> tuple[int, int] | None:
    """The histogram (a labelled child is one) and the bucket `value` falls in, as
    prometheus_client finds it (the first upper bound at or above it). Its bounds are not
    public: without them (None), every observation gets an exemplar."""
    bounds = getattr(histogram, "_upper_bounds", None)
    if bounds is None:
        return None
    return id(histogram), bisect.bisect_left(bounds, value)


def observe_queue_wait(lane: str, enqueued_ms: int) -> float:
    """Observe and return the wait; a Redis clock ahead of ours counts as no wait."""
    wait_s = max(0.0, time.time() - enqueued_ms / 1000)
    observe(QUEUE_WAIT_SECONDS.labels(lane), wait_s)
    return wait_s


# ---- the feeder. A tenant label only for tenants named in
# DARKROOM_TENANT_WEIGHTS, every other tenant is `other`: 10,000 tenants must not become
# 10,000 series per metric (per-tenant totals of all tenants are in PostgreSQL).
FED = Counter("darkroom_fed_total", "Photos the feeder put into a lane's stream", ["lane"])
INTAKE_LAG_SECONDS = Histogram(
    "darkroom_intake_lag_seconds",
    "From a PostgreSQL-only row's commit to its XADD by the intake",
    buckets=(0.1, 0.25, 0.5, 0.75, 1, 2, 5, 10, 30, 60, 300),
)
BULK_TENANTS = Gauge("darkroom_bulk_tenants", "Tenants with bulk photos waiting (feeder's view)")
TENANT_PHOTOS = Counter("darkroom_tenant_photos_total", "Bulk photos rendered", ["tenant"])
TENANT_PIXELS = Counter("darkroom_tenant_pixels_total", "Bulk pixels rendered", ["tenant"])
OTHER_TENANT = "other"
THROTTLED = Counter(
    "darkroom_tenant_throttled_total",
    "Bulk batches in which a tenant's rate held photos back (the tenant waited)",
    ["tenant"],
)


def count_tenant_done(tenant: str, pixels: int, named: Collection[str]) -> None:
    label = tenant if tenant in named else OTHER_TENANT
    TENANT_PHOTOS.labels(label).inc()
    TENANT_PIXELS.labels(label).inc(pixels)


Readiness = Callable[[], tuple[bool, dict[str, Any]]]


async def serve(port: int, ready: Readiness) -> asyncio.Server:
    """A minimal HTTP/1.0 responder; enough for Prometheus and container health checks."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            path = request.split(b" ")[1].decode() if request.count(b" ") >= 2 else "/"
            accept = await _accept_header(reader)
            status, ctype, body = _route(path, ready, accept)
            head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(respond, "0.0.0.0", port)


async def _accept_header(reader: asyncio.StreamReader) -> str:
    """The request's Accept header ("" if none), its other headers read and dropped; a client
    that never ends its headers is answered as one without (as before headers were read)."""
    accept = ""
    for _ in range(_MAX_HEADERS):
        try:
            raw = await asyncio.wait_for(reader.readline(), _HEADER_WAIT_S)
        except TimeoutError:
            break
        line = raw.decode("latin-1").strip()
        if not line:
            break
        name, _, value = line.partition(":")
        if name.strip().lower() == "accept":
            accept = value.strip()
    return accept


# Enough for any scraper or probe; a client sending more is cut off, not waited for.
_MAX_HEADERS = 100
_HEADER_WAIT_S = 1.0


def _route(path: str, ready: Readiness, accept: str = "") -> tuple[str, str, bytes]:
    if path.startswith("/metrics"):
        # OpenMetrics (with exemplars) only when asked: an old scraper keeps the text format
        encoder, ctype = choose_encoder(accept)
        return "200 OK", ctype, encoder(REGISTRY)
    if path.startswith("/livez"):
        return "200 OK", "text/plain", b"ok\n"
    if path.startswith("/readyz"):
        # 503 names what is wrong: {"down": {"queue": "read_only: ..."}, "stopping": false}
        ok, detail = ready()
        body = json.dumps(detail, sort_keys=True).encode() + b"\n"
        return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
    return "404 Not Found", "text/plain", b"not found\n"


# -- queue gauges and outage gauges ---------------------------------------------------------

# Filled from Redis and Postgres by `darkroom web` from its shared snapshot (one process,
# so no double counting); kept in their own registry so workers never export them.
QUEUE_REGISTRY = CollectorRegistry(auto_describe=True)
STREAM_LENGTH = Gauge(
    "darkroom_stream_length", "Entries in the work stream (the backlog)", registry=QUEUE_REGISTRY
)
GROUP_LAG = Gauge("darkroom_group_lag", "Entries not yet delivered", registry=QUEUE_REGISTRY)
GROUP_PENDING = Gauge(
    "darkroom_group_pending", "Entries delivered, not yet acked", registry=QUEUE_REGISTRY
)
DEAD_LETTERS = Gauge(
    "darkroom_dead_letters", "Entries in the dead-letter stream", registry=QUEUE_REGISTRY
)
PHOTOS = Gauge("darkroom_photos", "Photos by state", ["state"], registry=QUEUE_REGISTRY)
PHOTOS_ESTIMATED = Gauge(
    "darkroom_photos_estimated",
    "1 when a darkroom_photos count past the exact cap is the planner's estimate",
    registry=QUEUE_REGISTRY,
)
# ---- lanes: the same per lane, and how long each lane's oldest entry waited
LANE_LENGTH = Gauge("darkroom_lane_length", "Entries in a lane's work stream", ["lane"],
                    registry=QUEUE_REGISTRY)  # fmt: skip
LANE_LAG = Gauge("darkroom_lane_lag", "A lane's entries not yet delivered", ["lane"],
                 registry=QUEUE_REGISTRY)  # fmt: skip
LANE_OLDEST_WAIT_SECONDS = Gauge(
    "darkroom_lane_oldest_wait_seconds",
    "Age of the oldest entry still in a lane's stream",
    ["lane"],
    registry=QUEUE_REGISTRY,
)
# The tenants' own rates (PostgreSQL's tenant_limits; 0: exempt from DARKROOM_TENANT_RATE).
TENANT_RATE_LIMIT = Gauge(
    "darkroom_tenant_rate_limit",
    "A tenant's own bulk rate limit, photos per second",
    ["tenant"],
    registry=QUEUE_REGISTRY,
)
PAUSED = Gauge(
    "darkroom_paused",
    "1 for each scope an operator paused ('*': every lane or every tenant)",
    ["lane", "tenant"],
    registry=QUEUE_REGISTRY,
)
# What the page itself costs: one snapshot is one count query, however many viewers.
WEB_SNAPSHOTS = Counter(
    "darkroom_web_snapshots_total",
    "Status snapshots taken by darkroom web (one count query each)",
    registry=QUEUE_REGISTRY,
)
WEB_DOWNLOADS_REFUSED = Counter(
    "darkroom_web_downloads_refused_total",
    "Downloads refused with 503 because DARKROOM_WEB_DOWNLOADS were in progress",
    registry=QUEUE_REGISTRY,
)
DEPENDENCY_DOWN = Gauge(
    "darkroom_dependency_down", "1 while the worker sees this dependency down", ["dependency"]
)


def watch_outages(down: Collection[str], dependencies: Iterable[str]) -> None:
    """Export the worker's set of dependencies it currently sees down (read at scrape time)."""

    def seen_down(dependency: str) -> Callable[[], float]:
        return lambda: float(dependency in down)

    for dependency in dependencies:
        DEPENDENCY_DOWN.labels(dependency).set_function(seen_down(dependency))


def queue_metrics(report: dict[str, Any]) -> bytes:
    """The queue gauges from one status report, in Prometheus text."""
    STREAM_LENGTH.set(report["length"])
    GROUP_LAG.set(report["lag"] or 0)
    GROUP_PENDING.set(report["pending"])
    DEAD_LETTERS.set(report["dead_letters"])
    for state in ("uploaded", "processing", "processed", "processing_failed", "erased"):
        PHOTOS.labels(state).set(report["photos"].get(state, 0))
    PHOTOS_ESTIMATED.set(1 if report.get("photos_estimated") else 0)
    for lane, numbers in report.get("lanes", {}).items():
        LANE_LENGTH.labels(lane).set(numbers["length"])
        LANE_LAG.labels(lane).set(numbers["lag"] or 0)
        LANE_OLDEST_WAIT_SECONDS.labels(lane).set(numbers.get("oldest_wait_s") or 0)
    TENANT_RATE_LIMIT.clear()  # a cleared limit's series goes with it
    for limit in report.get("limits", []):
        TENANT_RATE_LIMIT.labels(limit["tenant"]).set(limit["per_s"])
    PAUSED.clear()  # a resumed scope's series ends
    for pause in report.get("pauses", []):
        tenant = "*" if pause["tenant"] is None else pause["tenant"]
        PAUSED.labels(pause["lane"] or "*", tenant).set(1)
    return generate_latest(QUEUE_REGISTRY)
