"""A loopback OTLP/HTTP receiver that decodes the protobuf workers export (POST /v1/traces),
span by span, and a producer's span for the photos it sends: the tests' and the benches'
(bench/tracing.py, bench/trace_chaos.py) collector, with no collector binary to run."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    status: int
    service: str
    start_ns: int = 0
    end_ns: int = 0


@dataclass
class Receiver:
    """What the workers exported, span by span, and the endpoint they export to."""

    endpoint: str = ""
    spans: list[Span] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    exports: int = 0
    export_bytes: int = 0
    broken: int = 0  # exports cut mid-request (a SIGKILLed worker's connection reset)

    def of_trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def decoded(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for rs in request.resource_spans:
        service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
        for ss in rs.scope_spans:
            for s in ss.spans:
                attributes = {a.key: _value(a.value) for a in s.attributes}
                ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                spans.append(Span(*ids, s.name, s.kind, attributes, s.status.code, str(service),
                                  s.start_time_unix_nano, s.end_time_unix_nano))  # fmt: skip
    return spans


@contextmanager
def serving(keep: bool = True) -> Iterator[Receiver]:
    """The receiver on a loopback port while the block runs; `keep` False decodes every
    export (the cost a collector's receiver has) and counts it, keeping no span."""
    got, lock = Receiver(), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a collector serves: one connection

        def do_POST(self) -> None:
            body = self._body()
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            spans = decoded(body)
            with lock:
                got.paths.append(self.path)
                got.exports += 1
                got.export_bytes += len(body)
                if keep:
                    got.spans.extend(spans)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def _body(self) -> bytes:
            """Sized (Python's exporter) or chunked (Node's)."""
            if self.headers.get("Content-Length") is not None:
                return self.rfile.read(int(self.headers["Content-Length"]))
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after each chunk
            self.rfile.readline()  # the CRLF after the last, empty chunk
            return b"".join(chunks)

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            with lock:
                got.broken += 1

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    got.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()


def producer_span() -> tuple[str, str, dict[str, str]]:
    """A producer's span (ended, not exported): its trace id, span id and W3C fields."""
    tracer = TracerProvider().get_tracer("tests.producer")
    span = tracer.start_span("photos publish", kind=SpanKind.PRODUCER)
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    span.end()
    context = span.get_span_context()
    return format_trace_id(context.trace_id), format_span_id(context.span_id), carrier
