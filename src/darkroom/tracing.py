"""OpenTelemetry traces through the queue: the adapter, with its parts stagespans.py (the
stages' spans), confirmations.py (what the exporter delivered) and otlpwire.py (the exporter)
(docs/tracing.md). On when
an OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and
OTEL_SDK_DISABLED is not `true`; off, every function here is a no-op and no OpenTelemetry
module is imported. Nothing below the orchestration imports this module (the layers contract).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import time
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

from darkroom import confirmations, metrics, otlpwire, stagespans
from darkroom.queue.messages import TRACE_FIELDS, Entry, enqueued_ms, trace_fields

# The SDK's tracer once `start` installed it; None: tracing is off.
_tracer: Any = None
# Its provider, which `flush` flushes (the global one may be another's, set before `start`).
_provider: Any = None
# The delivery's own span (`darkroom.process`), its context and whether it records: its stages
# set the attempt, outcome and error on it; everything inside it but a stage names it, read
# here without the OpenTelemetry context's lookups (so a tracer's span made current inside a
# delivery would not be seen: stages are stagespans.py's, and none is).
_delivery: contextvars.ContextVar[tuple[Any, Any, bool] | None] = contextvars.ContextVar(
    "darkroom_delivery", default=None
)
# The last span context's ids in hex, as an exemplar's labels: a delivery's histograms and log
# lines name the same few spans again and again.
_last_ids: tuple[Any, dict[str, str]] = (None, {})
# The span id the next span made in this context is given (`_preset_ids`): a dead delivery's,
# whose span its reclaimer writes. None: a random one, as the SDK's default.
_preset_span_id: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "darkroom_preset_span_id", default=None
)
# The delivery's span joined a trace the photo carries (its entry had a context, and the
# sampler kept it): only then is its id kept on the attempt row, for a span written for it
# later to have a trace to join.
_joined: contextvars.ContextVar[bool] = contextvars.ContextVar("darkroom_joined", default=False)
# The current delivery's `note`s, set on its span once as it ends: one attribute update (the
# SDK validates each and takes the span's lock) instead of one per note.
_notes: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "darkroom_notes", default=None
)


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    return bool(endpoint) and environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def on() -> bool:
    return _tracer is not None


def tracer() -> Any:
    """The SDK's tracer; None when off."""
    return _tracer


@contextlib.contextmanager
def preset(span_id: int) -> Iterator[None]:
    """The next span made in this context gets `span_id` (the IdGenerator `start` installs)."""
    token = _preset_span_id.set(span_id)
    try:
        yield
    finally:
        _preset_span_id.reset(token)


def start() -> bool:
    """Install the SDK when `wanted`: the sampler from OTEL_TRACES_SAMPLER (parent-based by
    default), spans batched (OTEL_BSP_*) to OTLP over HTTP/protobuf, flushed at exit. True if on."""
    if _tracer is not None or not wanted():
        return on()
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, name the service instead
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = _hashed(Resource.create({} if named else {"service.name": "darkroom"}))
    provider = TracerProvider(resource=resource, id_generator=_preset_ids())
    exporter = otlpwire.exporter()
    processor = BatchSpanProcessor(confirmations.confirming(exporter))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    use(provider, processor)
    metrics.exemplars_from(exemplar)
    return True


def use(provider: Any, processor: Any) -> None:
    """Trace with `provider`, whose `processor` the stages' spans go to as its tracer's do
    (`start`'s, or a bench's in memory); None: off."""
    global _tracer, _provider
    _tracer = None if provider is None else provider.get_tracer("darkroom")
    _provider = provider
    if provider is None:
        stagespans.uninstall()
    else:
        stagespans.install(processor, provider.resource, _scope(), provider.id_generator)


def _hashed(resource: Any) -> Any:
    """The resource, its hash kept: the exporter groups each batch's spans by resource, and
    the SDK's `Resource.__hash__` dumps every attribute as JSON on each call, once per span
    (70 µs of a tiny photo's 15 spans)."""
    from opentelemetry.sdk.resources import Resource

    class Hashed(Resource):
        def __hash__(self) -> int:
            return kept

    kept = hash(resource)
    return Hashed(resource.attributes, resource.schema_url)


def _scope() -> Any:
    """The instrumentation scope `get_tracer("darkroom")` gives its spans, for the stages'."""
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    return InstrumentationScope("darkroom", "")  # get_tracer's version when none is given


def _preset_ids() -> Any:
    """The SDK's random ids, but the span id `preset` gives the one span spanwriter.py makes:
    an IdGenerator is the SDK's own extension point for choosing ids (docs/tracing.md)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PresetIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            preset = _preset_span_id.get()
            return super().generate_span_id() if preset is None else preset

    return PresetIds()


def flush() -> bool:
    """Export every ended span now, within the exporter's timeout (blocking: call it from a
    thread); False: not within it."""
    if _provider is None:
        return True
    return bool(_provider.force_flush(int(otlpwire.export_timeout_s() * 1000)))


@functools.cache
def propagator() -> Any:
    """The W3C trace context propagator (one: it keeps no state)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def injected() -> dict[str, str]:
    """The current stage's or span's context as W3C fields (traceparent, tracestate); {} when
    off or outside any span."""
    if _tracer is None:
        return {}
    from opentelemetry.trace import NonRecordingSpan, set_span_in_context

    carrier: dict[str, str] = {}
    stage = stagespans.current.get()
    within = None if stage is None else set_span_in_context(NonRecordingSpan(stage.context))
    propagator().inject(carrier, context=within)
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
        token = stagespans.current.set(None)  # the producer's span is the one to carry
        held = _delivery.set(None)
        try:
            yield injected()
        finally:
            _delivery.reset(held)
            stagespans.current.reset(token)


@contextlib.contextmanager
def delivery(entry: Entry, deliveries: int, stream: str, group: str) -> Iterator[None]:
    """One `darkroom.process` consumer span per delivery, the child of the context the entry
    carried (none: a trace of its own); a first delivery's queue wait (from the entry id's
    time to now, so it starts before its parent) is its first child."""
    if _tracer is None:
        yield
        return
    from opentelemetry.trace import SpanKind

    parent = propagator().extract(trace_fields(entry.fields))
    attributes = _delivery_attributes(entry, deliveries, stream, group)
    now_ns = time.time_ns()
    with _tracer.start_as_current_span(
        "darkroom.process", context=parent, kind=SpanKind.CONSUMER, attributes=attributes,
        record_exception=False, set_status_on_exception=False,
    ) as current:  # fmt: skip
        context, recording = current.get_span_context(), current.is_recording()
        token = _delivery.set((current, context, recording))
        joined = _joined.set(recording and has_context(parent))
        notes = _notes.set({})
        try:
            # a later delivery's wait would count the earlier attempts
            if deliveries == 1 and recording:
                stagespans.made("darkroom.queue_wait", context, _id_ns(entry), now_ns)
            yield
        finally:
            current.set_attributes(_notes.get() or {})
            _notes.reset(notes)
            _joined.reset(joined)
            _delivery.reset(token)


def has_context(parent: Any) -> bool:
    """Whether an extracted context names a span to join."""
    from opentelemetry import trace

    return bool(trace.get_current_span(parent).get_span_context().is_valid)


def _delivery_attributes(entry: Entry, deliveries: int, stream: str, group: str) -> dict[str, Any]:
    """OpenTelemetry's messaging conventions where they fit, darkroom's own otherwise."""
    attributes = messaging(stream, group, entry.id) | {
        "darkroom.lane": entry.lane,
        "darkroom.delivery_count": deliveries,
        "darkroom.photo_id": entry.fields.get("photo_id", "")[:80],
    }
    if "tenant" in entry.fields:
        attributes["darkroom.tenant"] = entry.fields["tenant"]
    return attributes


def delivery_span_id() -> str | None:
    """The current delivery's span id (16 hex digits), which its claim keeps on the attempt
    row; None when off, outside a delivery, or for a span in no trace of the photo's (its
    entry carried no context) or not sampled: no span could be written for it later."""
    current = _delivery.get()
    if current is None or not _joined.get():
        return None
    return format(current[1].span_id, "016x")


def messaging(stream: str, group: str, entry_id: str) -> dict[str, Any]:
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
    child span (stagespans.py), the current stage meanwhile; an error leaving it is recorded
    with its stable code. Outside a recording span: nothing."""
    parent = _recording_context()
    if parent is None:
        yield
        return
    stage = stagespans.begin(f"darkroom.{name}", parent)
    token = stagespans.current.set(stage)
    try:
        yield
    except Exception as exc:
        stage.failed(getattr(exc, "code", type(exc).__name__), str(exc))
        raise
    finally:
        stagespans.current.reset(token)
        stagespans.end(stage)


def recording() -> bool:
    """Whether a stage begun here would be recorded (a sampled delivery's span is current)."""
    return _recording_context() is not None


def _recording_context() -> Any:
    """The context of the current stage, else of the current span if it records; None when
    off or outside any (a stage there would be a trace of its own, of no photo)."""
    if _tracer is None:
        return None
    context, recording = _current()
    return context if recording else None


def _current_context() -> Any:
    """The SpanContext an exemplar, a log line or a propagated context names: the current
    stage's, else the current span's."""
    return _current()[0]


def _current() -> tuple[Any, bool]:
    """The current stage's context, else the current span's; and whether it records (a stage
    is made only under a span that does)."""
    stage = stagespans.current.get()
    if stage is not None:
        return stage.context, True
    held = _delivery.get()
    if held is not None:
        return held[1], held[2]
    from opentelemetry import trace

    current = trace.get_current_span()
    return current.get_span_context(), current.is_recording()


def rendered(stages: Iterable[Any]) -> None:
    """The render process's own stages (image/stagetimes.py: decode, resize, encode...), timed
    there on the same wall clock, as children of the current span (the render's)."""
    parent = _recording_context()
    if parent is None:
        return
    for stage in stages:
        named = {"darkroom.rendition": stage.rendition} if stage.rendition else None
        stagespans.made(f"darkroom.{stage.name}", parent, stage.start_ns, stage.end_ns, named)


def note(**attributes: Any) -> None:
    """Attributes of the current delivery's span (its attempt, outcome, tenant...), set as
    it ends; a later note of the same name wins."""
    notes = _notes.get()
    if notes is not None:
        notes.update({f"darkroom.{k}": v for k, v in attributes.items()})


def failed(code: str, message: str) -> None:
    """The delivery ended in an error: its span's status, `error.type` the stable code."""
    current = _delivery.get()
    if current is not None:
        record_error(current[0], code, message)
        current[0].set_attribute("darkroom.error_code", code)


def record_error(current: Any, code: str, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("error.type", code)
    current.add_event("exception", {"exception.type": code, "exception.message": message})
    current.set_status(Status(StatusCode.ERROR, f"{code}: {message}"[:500]))


def exemplar() -> dict[str, str] | None:
    """The current sampled span's ids for a histogram's exemplar (an OpenMetrics scrape shows
    them beside the bucket); None when off or outside a span, so off costs one check."""
    if _tracer is None:
        return None
    context = _current_context()
    if not (context.is_valid and context.trace_flags.sampled):
        return None
    return _ids(context)


def log_ids(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` and `span_id` on every line logged inside a span."""
    if _tracer is None:
        return event
    context = _current_context()
    if context.is_valid:
        ids = _ids(context)
        event.setdefault("trace_id", ids["trace_id"])
        event.setdefault("span_id", ids["span_id"])
    return event


def _ids(context: Any) -> dict[str, str]:
    """The context's ids in hex (kept for the next call: shared, never to be changed)."""
    global _last_ids
    last = _last_ids
    if last[0] is context:
        return last[1]
    ids = {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}
    _last_ids = (context, ids)
    return ids
