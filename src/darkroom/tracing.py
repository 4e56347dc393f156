"""OpenTelemetry traces through the queue: the one adapter (docs/tracing.md). On when an OTLP
endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and
OTEL_SDK_DISABLED is not `true`; off, every function here is a no-op and no OpenTelemetry
module is imported. Nothing below the orchestration imports this module (the layers contract).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from darkroom.queue.messages import TRACE_FIELDS, Entry, enqueued_ms, trace_fields

# The SDK's tracer once `start` installed it; None: tracing is off.
_tracer: Any = None
# The exporter's timeout unless OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT says otherwise: the flush at
# exit waits this long for a collector that is down (the SDK's 10 s measured 10.8 s), which
# must fit in the stop's margin past DARKROOM_SHUTDOWN_GRACE_S (compose's is 10 s).
EXPORT_TIMEOUT_S = 3.0
# The delivery's own span (`darkroom.process`): its stages set the attempt, outcome and error
# on it from inside their child spans.
_delivery: contextvars.ContextVar[Any] = contextvars.ContextVar("darkroom_delivery", default=None)


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    return bool(endpoint) and environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def on() -> bool:
    return _tracer is not None


def start() -> bool:
    """Install the SDK when `wanted`: the sampler from OTEL_TRACES_SAMPLER (parent-based by
    default), spans batched (OTEL_BSP_*) to OTLP over HTTP/protobuf, flushed at exit. True if on."""
    global _tracer
    if _tracer is not None or not wanted():
        return on()
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, name the service instead
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": "darkroom"})
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(timeout=None if _timeout_set() else EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("darkroom")
    return True


def _timeout_set() -> bool:
    return any(
        name in os.environ
        for name in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
    )


def _propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def injected() -> dict[str, str]:
    """The current span's context as W3C fields (traceparent, tracestate); {} when off or
    outside any span."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator().inject(carrier)
    return {k: v for k, v in carrier.items() if k in TRACE_FIELDS}


@contextlib.contextmanager
def producer(name: str, **attributes: Any) -> Iterator[dict[str, str]]:
    """A producer span (`darkroom ingest`, `enqueue`); yields the fields its entry and row
    carry so the consumer's spans join its trace ({} when off)."""
    if _tracer is None:
        yield {}
        return
    from opentelemetry.trace import SpanKind

    named = {f"darkroom.{k}": v for k, v in attributes.items()}
    with _tracer.start_as_current_span(name, kind=SpanKind.PRODUCER, attributes=named):
        yield injected()


@contextlib.contextmanager
def delivery(entry: Entry, deliveries: int, stream: str, group: str) -> Iterator[None]:
    """One `darkroom.process` consumer span per delivery, the child of the context the entry
    carried (none: a trace of its own); a first delivery's queue wait (from the entry id's
    time to now, so it starts before its parent) is its first child."""
    if _tracer is None:
        yield
        return
    from opentelemetry.trace import SpanKind

    parent = _propagator().extract(trace_fields(entry.fields))
    attributes = _delivery_attributes(entry, deliveries, stream, group)
    now_ns = time.time_ns()
    with _tracer.start_as_current_span(
        "darkroom.process", context=parent, kind=SpanKind.CONSUMER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as current:  # fmt: skip
        token = _delivery.set(current)
        try:
            if deliveries == 1:  # a later one's wait would count the earlier attempts
                waited = _tracer.start_span("darkroom.queue_wait", start_time=_id_ns(entry))
                waited.end(end_time=max(now_ns, _id_ns(entry)))
            yield
        finally:
            _delivery.reset(token)


def _delivery_attributes(entry: Entry, deliveries: int, stream: str, group: str) -> dict[str, Any]:
    """OpenTelemetry's messaging conventions where they fit, darkroom's own otherwise."""
    attributes: dict[str, Any] = {
        "messaging.system": "redis",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": stream,
        "messaging.consumer.group.name": group,
        "messaging.message.id": entry.id,
        "darkroom.lane": entry.lane,
        "darkroom.delivery_count": deliveries,
        "darkroom.photo_id": entry.fields.get("photo_id", "")[:80],
    }
    if "tenant" in entry.fields:
        attributes["darkroom.tenant"] = entry.fields["tenant"]
    return attributes


def _id_ns(entry: Entry) -> int:
    return enqueued_ms(entry) * 1_000_000


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """A stage of the current delivery (claim, download, render, upload, publish, ack): a
    child span; an error leaving it is recorded with its stable code."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(
        f"darkroom.{name}", record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield
        except Exception as exc:
            _record(current, getattr(exc, "code", type(exc).__name__), str(exc))
            raise


def note(**attributes: Any) -> None:
    """Attributes of the current delivery's span (its attempt, outcome, tenant...)."""
    current = _delivery.get()
    if current is not None:
        current.set_attributes({f"darkroom.{k}": v for k, v in attributes.items()})


def failed(code: str, message: str) -> None:
    """The delivery ended in an error: its span's status, `error.type` the stable code."""
    current = _delivery.get()
    if current is not None:
        _record(current, code, message)
        current.set_attribute("darkroom.error_code", code)


def _record(current: Any, code: str, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("error.type", code)
    current.add_event("exception", {"exception.type": code, "exception.message": message})
    current.set_status(Status(StatusCode.ERROR, f"{code}: {message}"[:500]))


def log_ids(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` and `span_id` on every line logged inside a span."""
    if _tracer is None:
        return event
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event
