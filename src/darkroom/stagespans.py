"""A delivery's stage spans (its queue wait, claim, download, render and the render process's
stages, upload, publish, ack), each made once, ended: a `ReadableSpan` handed to the batch
processor when the stage ends, not a span of the SDK's tracer opened at its start and made
the current context. The tracer's way costs 15–18 µs a span (a sampling decision, a span with
its locks and bounded collections, a context attached and detached, a readable copy at its
end) against about 2.5 µs here, and a tiny photo has 14 of them (docs/tracing.md#cost-when-on).
What the tracer would decide comes from the parent: a stage is made only under a span that
records, so it is sampled as the parent-based sampler would sample it.

Only `darkroom.tracing` uses this module; it imports OpenTelemetry only once `install`ed.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from typing import Any

# (processor, resource, scope, id generator) once tracing is on: what the tracer would have
# given a span it made, so these spans are exported in the same batches and grouped with its.
_sink: tuple[Any, Any, Any, Any] | None = None
# The SDK's classes, bound by `install` (an import statement in each call costs more than
# the rest of a span's making).
_SpanContext: Any = None
_ReadableSpan: Any = None
_Event: Any = None
_Status: Any = None
_UNSET: Any = None
_NO_EVENTS: tuple[Any, ...] = ()
# The attribute value length limits of a span's and of an event's attributes (None: none)
_LENGTH: tuple[int | None, int | None] = (None, None)


@dataclass(slots=True)
class OpenStage:
    """An open stage: its own context (children name it as their parent) and what its span
    will carry."""

    name: str
    parent: Any  # the parent's SpanContext
    context: Any  # this stage's SpanContext
    start_ns: int
    error: tuple[str, str, int] | None = None  # code, message, when

    def failed(self, code: str, message: str) -> None:
        self.error = (code, message, time.time_ns())


# The open stage of this task's delivery, if any: the parent of a stage or render stage
# begun inside it, and the span an exemplar or a log line inside it names.
current: contextvars.ContextVar[OpenStage | None] = contextvars.ContextVar(
    "darkroom_stage", default=None
)


def install(processor: Any, resource: Any, scope: Any, ids: Any) -> None:
    """Where the stages go: the tracer provider's span processor, with its resource, the
    tracer's instrumentation scope and id generator."""
    global _sink, _SpanContext, _ReadableSpan, _Event, _Status, _UNSET, _LENGTH
    from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
    from opentelemetry.trace import SpanContext, Status

    _SpanContext, _ReadableSpan, _Event, _Status = SpanContext, ReadableSpan, Event, Status
    _UNSET = Status()
    # OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT and its span and event forms, as the SDK's spans
    # apply them: only an error's code and message here can be long
    limits = SpanLimits()
    _LENGTH = (limits.max_span_attribute_length, limits.max_attribute_length)
    _sink = (processor, resource, scope, ids)


def uninstall() -> None:
    """Tracing off: no stage span may be made."""
    global _sink
    _sink = None


def begin(name: str, parent: Any) -> OpenStage:
    """A stage starting now under `parent` (a SpanContext that records)."""
    return OpenStage(name, parent, _child_of(parent), time.time_ns())


def end(stage: OpenStage) -> None:
    """The stage's span, ended now, to the exporter's queue."""
    _emit(stage.name, stage.parent, stage.context, stage.start_ns, time.time_ns(), None,
          stage.error)  # fmt: skip


def made(name: str, parent: Any, start_ns: int, end_ns: int,
         attributes: dict[str, Any] | None = None) -> None:  # fmt: skip
    """A span of a stage timed elsewhere (the queue wait, a render process's stage)."""
    _emit(name, parent, _child_of(parent), start_ns, end_ns, attributes, None)


def _child_of(parent: Any) -> Any:
    """A new span's context in the parent's trace, sampled as the parent is."""
    span_id = _installed()[3].generate_span_id()
    return _SpanContext(parent.trace_id, span_id, False, parent.trace_flags, parent.trace_state)


def _emit(
    name: str,
    parent: Any,
    context: Any,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any] | None,
    error: tuple[str, str, int] | None,
) -> None:
    processor, resource, scope, _ = _installed()
    status, events = _UNSET, _NO_EVENTS
    if error is not None:  # as tracing.record_error marks the SDK's spans
        from opentelemetry.trace import StatusCode

        code, message, at_ns = error
        attributes = (attributes or {}) | {"error.type": code[: _LENGTH[0]]}
        short = code[: _LENGTH[1]], message[: _LENGTH[1]]
        thrown = {"exception.type": short[0], "exception.message": short[1]}
        status = _Status(StatusCode.ERROR, f"{code}: {message}"[:500])
        events = (_Event("exception", thrown, at_ns),)
    processor.on_end(_ReadableSpan(
        name, context, parent, resource, attributes, events, status=status,
        start_time=start_ns, end_time=max(end_ns, start_ns), instrumentation_scope=scope,
    ))  # fmt: skip


def _installed() -> tuple[Any, Any, Any, Any]:
    if _sink is None:
        raise RuntimeError("stage spans made before tracing.use installed a processor")
    return _sink
