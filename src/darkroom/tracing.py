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
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import structlog

from darkroom import metrics
from darkroom.errors import WorkerDiedError
from darkroom.queue.messages import TRACE_FIELDS, Entry, enqueued_ms, trace_fields

if TYPE_CHECKING:
    from darkroom.store.leases import Died

# The SDK's tracer once `start` installed it; None: tracing is off.
_tracer: Any = None
# The exporter's timeout unless OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT says otherwise: the flush at
# exit waits this long for a collector that is down (the SDK's 10 s measured 10.8 s), which
# must fit in the stop's margin past DARKROOM_SHUTDOWN_GRACE_S (compose's is 10 s).
EXPORT_TIMEOUT_S = 3.0
# The delivery's own span (`darkroom.process`): its stages set the attempt, outcome and error
# on it from inside their child spans.
_delivery: contextvars.ContextVar[Any] = contextvars.ContextVar("darkroom_delivery", default=None)
# The span id the next span made in this context is given (`_preset_ids`): a dead delivery's,
# whose span its reclaimer writes. None: a random one, as the SDK's default.
_preset_span_id: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "darkroom_preset_span_id", default=None
)


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
    provider = TracerProvider(resource=resource, id_generator=_preset_ids())
    exporter = OTLPSpanExporter(timeout=None if _timeout_set() else EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("darkroom")
    metrics.exemplars_from(exemplar)
    return True


def _preset_ids() -> Any:
    """The SDK's random ids, but a span id preset by `worker_died` for the one span it makes:
    an IdGenerator is the SDK's own extension point for choosing ids (docs/tracing.md)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PresetIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            preset = _preset_span_id.get()
            return super().generate_span_id() if preset is None else preset

    return PresetIds()


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
    attributes = _messaging(stream, group, entry.id) | {
        "darkroom.lane": entry.lane,
        "darkroom.delivery_count": deliveries,
        "darkroom.photo_id": entry.fields.get("photo_id", "")[:80],
    }
    if "tenant" in entry.fields:
        attributes["darkroom.tenant"] = entry.fields["tenant"]
    return attributes


def delivery_span_id() -> str | None:
    """The current delivery's span id (16 hex digits), which its claim keeps on the attempt
    row; None when off or outside a delivery."""
    current = _delivery.get()
    if current is None:
        return None
    return format(current.get_span_context().span_id, "016x")


def worker_died(died: Died, stream: str, group: str, photo_id: str) -> None:
    """The `darkroom.process` span of a delivery whose worker died, written by the delivery
    that took its job: its own span id (the stages it exported name it as their parent), in
    the photo's trace, from the claim that started it to now, `worker_died`. A photo without a
    trace context left no trace to join (that delivery's span was a trace of its own).
    Never raises: the claim it follows is committed, and a span is not worth the photo."""
    if _tracer is None:
        return
    try:
        _write_died(died, stream, group, photo_id)
    except Exception as exc:  # the SDK's failures are many and not ours
        structlog.get_logger("darkroom.tracing").warning(
            "dead delivery's span not written", photo_id=photo_id, error=repr(exc)
        )


def _write_died(died: Died, stream: str, group: str, photo_id: str) -> None:
    assert _tracer is not None  # worker_died looked
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    parent = _propagator().extract({"traceparent": died.traceparent or ""})
    span_id = _span_id(died.span_id)
    if span_id is None or not trace.get_current_span(parent).get_span_context().is_valid:
        return
    start_ns = int(died.started_at.timestamp() * 1e9)
    token = _preset_span_id.set(span_id)
    try:
        dead = _tracer.start_span("darkroom.process", context=parent, kind=SpanKind.CONSUMER,
                                  attributes=_died_attributes(died, stream, group, photo_id),
                                  start_time=start_ns)  # fmt: skip
    finally:
        _preset_span_id.reset(token)
    code = WorkerDiedError.code
    _record(dead, code, "the worker died before this delivery ended; written at its reclaim")
    dead.set_attribute("darkroom.error_code", code)
    dead.end(end_time=max(start_ns, time.time_ns()))


def _span_id(stored: str) -> int | None:
    """The column's span id, None when it is not one (16 hex digits, not all zero)."""
    try:
        span_id = int(stored, 16) if len(stored) == 16 else 0
    except ValueError:
        return None
    return span_id or None


def _died_attributes(died: Died, stream: str, group: str, photo_id: str) -> dict[str, Any]:
    """The live span's, but what died with the worker (its delivery count, its outcome)."""
    attributes = _messaging(stream, group, died.entry_id) | {
        "darkroom.lane": died.lane,
        "darkroom.photo_id": photo_id,
        "darkroom.attempt": died.attempt,
        "darkroom.claim": "claimed",
        "darkroom.outcome": WorkerDiedError.code,
    }
    if died.lane == "bulk" and died.tenant:
        attributes["darkroom.tenant"] = died.tenant
    return attributes


def _messaging(stream: str, group: str, entry_id: str) -> dict[str, Any]:
    return {
        "messaging.system": "redis",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": stream,
        "messaging.consumer.group.name": group,
        "messaging.message.id": entry_id,
    }


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


def rendered(stages: Iterable[Any]) -> None:
    """The render process's own stages (image/stagetimes.py: decode, resize, encode...), timed
    there on the same wall clock, as children of the current span (the render's)."""
    if _tracer is None:
        return
    for stage in stages:
        named = {"darkroom.rendition": stage.rendition} if stage.rendition else {}
        done = _tracer.start_span(f"darkroom.{stage.name}", start_time=stage.start_ns,
                                  attributes=named)  # fmt: skip
        done.end(end_time=stage.end_ns)


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


def exemplar() -> dict[str, str] | None:
    """The current sampled span's ids for a histogram's exemplar (an OpenMetrics scrape shows
    them beside the bucket); None when off or outside a span, so off costs one check."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not (context.is_valid and context.trace_flags.sampled):
        return None
    ids = format(context.trace_id, "032x"), format(context.span_id, "016x")
    return {"trace_id": ids[0], "span_id": ids[1]}


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
