"""Where a trace shows up outside the trace viewer: the exemplars of a traced worker's
histograms (OpenMetrics, only when the scraper asks; the header reading that negotiation needs
never strands a bare probe) and the photo page's link to the trace viewer
(DARKROOM_TRACE_URL), from real worker processes exporting to the loopback OTLP receiver of
tests/test_tracing.py."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
import urllib.request

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from darkroom import metrics
from tests.conftest import Env, free_port
from tests.test_recovery import wait_for
from tests.test_tracing import Receiver, add_photo, otel, producer_span, receiver, xadd

__all__ = ["receiver"]  # the fixture, used by name
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def scrape(port: int, accept: str | None) -> tuple[str, str]:
    """The worker's /metrics: its content type and body."""
    headers = {"Accept": accept} if accept else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


def exemplar_traces(body: str, metric: str) -> set[str]:
    """The trace ids of the exemplars on a histogram's bucket lines."""
    lines = [line for line in body.splitlines() if line.startswith(f"{metric}_bucket")]
    return {m for line in lines for m in re.findall(r'# \{.*trace_id="([0-9a-f]{32})"', line)}


def test_a_traced_workers_histograms_carry_its_trace_ids_as_openmetrics_exemplars(
    file_env: Env, receiver: Receiver
) -> None:
    """Scraped with OpenMetrics' Accept header, the stage and queue-wait histograms carry the
    photo's trace id (the one the receiver got) as exemplars; a scraper that does not ask
    gets the plain text format, with none."""
    trace_id, _, carrier = producer_span()
    photo_id = add_photo(file_env)
    xadd(file_env, photo_id, carrier)
    port = free_port()
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port), **otel(receiver))
    wait_for(file_env, "SELECT 1 FROM photos WHERE id = $1 AND processing_state = 'processed'",
             photo_id, proc=worker)  # fmt: skip
    open_type, open_body = scrape(port, OPENMETRICS)
    plain_type, plain_body = scrape(port, None)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert open_type.startswith("application/openmetrics-text")
    assert exemplar_traces(open_body, "darkroom_stage_seconds") == {trace_id}
    assert exemplar_traces(open_body, "darkroom_queue_wait_seconds") == {trace_id}
    assert trace_id in {s.trace_id for s in receiver.named("darkroom.render")}
    assert plain_type.startswith("text/plain") and "trace_id" not in plain_body
    assert "darkroom_stage_seconds_bucket" in plain_body


def test_with_tracing_off_an_observation_has_no_exemplar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing off: an OpenMetrics scrape of an observed histogram shows no exemplar."""
    monkeypatch.setattr(metrics, "_exemplar", None)  # as `tracing.start` leaves it when off
    registry = CollectorRegistry()
    histogram = Histogram("darkroom_test_seconds", "test", registry=registry)
    metrics.observe(histogram, 0.2)
    body = openmetrics(registry).decode()
    assert "darkroom_test_seconds_count 1.0" in body and "# {" not in body


def test_a_bucket_takes_a_new_exemplar_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape shows each bucket's latest exemplar: within a second of the last, an observation
    in the same bucket leaves it; one in another bucket sets its own; a second later the
    bucket takes the next; an observation outside a sampled span does not hold a bucket."""
    spans = iter(["a", "b", None, "c", "d"])

    def exemplar() -> dict[str, str] | None:
        span = next(spans)
        return None if span is None else {"trace_id": span * 32, "span_id": span * 16}

    clock = [100.0]
    monkeypatch.setattr(metrics, "_exemplar", exemplar)
    monkeypatch.setattr(metrics, "_now", lambda: clock[0])
    monkeypatch.setattr(metrics, "_exemplified", {})
    registry = CollectorRegistry()
    histogram = Histogram("darkroom_test_seconds", "test", registry=registry, buckets=(1, 10))

    def exemplars() -> dict[str, str]:
        lines = openmetrics(registry).decode().splitlines()
        found = (re.search(r'le="([^"]+)"\} .* # \{span_id="(.)', line) for line in lines)
        return {m.group(1): m.group(2) for m in found if m}

    metrics.observe(histogram, 0.5)  # a
    metrics.observe(histogram, 0.7)  # within the second: no exemplar asked for
    metrics.observe(histogram, 5.0)  # b, its own bucket
    assert exemplars() == {"1.0": "a", "10.0": "b"}
    clock[0] += 1.0
    metrics.observe(histogram, 0.2)  # None: no sampled span, the bucket keeps a
    metrics.observe(histogram, 0.3)  # c
    assert exemplars() == {"1.0": "c", "10.0": "b"}
    clock[0] += 1.0
    metrics.observe(histogram, float("nan"))  # in no bucket: no exemplar asked for, none held
    metrics.observe(histogram, 0.4)  # d
    assert exemplars() == {"1.0": "d", "10.0": "b"}


def test_the_photo_page_links_a_traced_photo_to_its_trace(file_env: Env) -> None:
    """With DARKROOM_TRACE_URL set, `darkroom web`'s photo page links the photo to the trace of
    its `traceparent`; an untraced photo has no link; a template without {trace_id} is
    refused at start."""
    trace_id, _, carrier = producer_span()
    traced = add_photo(file_env, traceparent=carrier["traceparent"])
    untraced = add_photo(file_env)
    port = free_port()
    viewer = "https://traces.example/trace/{trace_id}?from=darkroom"
    web = file_env.start("web", DARKROOM_WEB_PORT=str(port), DARKROOM_TRACE_URL=viewer)
    try:
        traced_page = page_when_up(f"http://127.0.0.1:{port}/photos/{traced}", web)
        untraced_page = page_when_up(f"http://127.0.0.1:{port}/photos/{untraced}", web)
    finally:
        web.send_signal(signal.SIGTERM)
        web.wait(30)
    link = viewer.replace("{trace_id}", trace_id).replace("&", "&amp;")
    assert f'<a href="{link}"' in traced_page and trace_id in traced_page
    assert "traces.example" not in untraced_page
    refused = file_env.cli("web", check=False, DARKROOM_TRACE_URL="http://jaeger:16686/trace/")
    assert refused.returncode == 2 and "DARKROOM_TRACE_URL" in refused.stderr


def page_when_up(url: str, proc: subprocess.Popen[str]) -> str:
    """The page's HTML, once the server answers."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return httpx.get(url, timeout=2).raise_for_status().text
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "darkroom web did not start"
            time.sleep(0.1)


def test_a_probe_that_never_ends_its_headers_is_still_answered() -> None:
    """Reading the Accept header never strands a bare probe: a request line with no blank
    line after it gets its answer once the header wait passes, not a dropped connection."""

    async def probe() -> bytes:
        server = await metrics.serve(0, lambda: (True, {}))
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /livez HTTP/1.0\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return answer
        finally:
            server.close()

    answer = asyncio.run(probe())
    assert answer.startswith(b"HTTP/1.0 200 OK") and answer.endswith(b"ok\n")
