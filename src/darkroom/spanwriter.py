"""Spans a delivery could not export itself, written by another from PostgreSQL's history
(docs/tracing.md): a SIGKILLed delivery's, by the delivery that reclaims its job
(`worker_died`), and any delivery's whose export no report confirmed, by the late writer
(latespans.py, `written_late`). Each gets the span id its claim kept on the attempt row, so
the stages it did export find their parent, and goes through the SDK's own pipeline (the
preset IdGenerator of tracing.py, its sampler, limits and batch processor).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from darkroom import tracing
from darkroom.errors import WorkerDiedError

if TYPE_CHECKING:
    from darkroom.store.leases import Died
    from darkroom.store.spans import Unsent


def worker_died(died: Died, stream: str, group: str, photo_id: str) -> None:
    """The `darkroom.process` span of a delivery whose worker died, written by the delivery
    that took its job: its own span id (the stages it exported name it as their parent), in
    the photo's trace, from the claim that started it to now, `worker_died`. A photo without a
    trace context left no trace to join (that delivery's span was a trace of its own).
    Never raises: the claim it follows is committed, and a span is not worth the photo."""
    if tracing.on():
        _never_raising("dead delivery's span not written", photo_id, _write_died, died, stream,
                       group, photo_id)  # fmt: skip


def _never_raising(failed: str, photo_id: str, write: Any, *args: Any) -> Any:
    """`write(*args)`, or None with a warning: the SDK's failures are many and not ours, and
    a span is not worth the delivery that writes it."""
    try:
        return write(*args)
    except Exception as exc:
        structlog.get_logger("darkroom.tracing").warning(failed, photo_id=photo_id,
                                                         error=repr(exc))  # fmt: skip
        return None


def _write_died(died: Died, stream: str, group: str, photo_id: str) -> None:
    start_ns = int(died.started_at.timestamp() * 1e9)
    attributes = _attributes(stream, group, died.entry_id, died.lane, photo_id, died.tenant,
                             WorkerDiedError.code)  # fmt: skip
    attributes |= {"darkroom.attempt": died.attempt, "darkroom.claim": "claimed"}
    message = "the worker died before this delivery ended; written at its reclaim"
    _write_process(died.span_id, died.traceparent, attributes, start_ns, time.time_ns(),
                   (WorkerDiedError.code, message))  # fmt: skip


def _write_process(
    stored_id: str, traceparent: str | None, attributes: dict[str, Any], start_ns: int,
    end_ns: int, error: tuple[str, str] | None,
) -> Any:  # fmt: skip
    """A `darkroom.process` span its delivery did not export, with the id its claim kept on
    the attempt row, in the photo's trace, ended; None: nothing to write (no trace context,
    no span id)."""
    tracer = tracing.tracer()
    assert tracer is not None  # the callers looked
    from opentelemetry.trace import SpanKind

    parent = tracing.propagator().extract({"traceparent": traceparent or ""})
    span_id = _span_id(stored_id)
    if span_id is None or not tracing.has_context(parent):
        return None
    with tracing.preset(span_id):
        written = tracer.start_span("darkroom.process", context=parent, kind=SpanKind.CONSUMER,
                                    attributes=attributes, start_time=start_ns)  # fmt: skip
    if not written.is_recording():  # the sampler dropped it: nothing will be exported
        return None
    if error is not None:
        tracing.record_error(written, *error)
        written.set_attribute("darkroom.error_code", error[0])
    written.end(end_time=max(start_ns, end_ns))
    return written


def written_late(unsent: Unsent, stream: str, group: str) -> bool:
    """The span of a delivery no export confirmed (store/spans.py), from its attempt row: its
    own id, in the photo's trace, from its claim to its end (a delivery that never ended: to
    the next claim, `worker_died`), its outcome and error, `darkroom.late` set; a published
    delivery's `darkroom.publish` child too, timed by the publishing statement itself (its
    start is the row's end, its length the row's publish_ms), so the trace reaches the final
    publish. True: handed to the batch processor; False: nothing to write, or the SDK
    failed (logged)."""
    if not tracing.on():
        return False
    written = _never_raising("late span not written", str(unsent.photo_id), _write_late,
                             unsent, stream, group)  # fmt: skip
    return bool(written)


def _write_late(unsent: Unsent, stream: str, group: str) -> bool:
    outcome = WorkerDiedError.code if unsent.ended_at is None else unsent.outcome
    attributes = _attributes(stream, group, unsent.entry_id, unsent.lane, str(unsent.photo_id),
                             unsent.tenant, outcome) | {"darkroom.late": True}  # fmt: skip
    written = _write_process(unsent.span_id, unsent.traceparent, attributes,
                             *_late_times(unsent), _late_error(unsent))  # fmt: skip
    if written is not None and unsent.outcome == "published":
        _write_publish(written, unsent)
    return written is not None


def _write_publish(process: Any, unsent: Unsent) -> None:
    from opentelemetry import trace

    tracer = tracing.tracer()
    assert unsent.ended_at is not None  # published
    start_ns = int(unsent.ended_at.timestamp() * 1e9)
    end_ns = start_ns + int((unsent.publish_ms or 0.0) * 1e6)
    context = trace.set_span_in_context(process)
    tracer.start_span("darkroom.publish", context=context, start_time=start_ns,
                      attributes={"darkroom.late": True}).end(end_time=end_ns)  # fmt: skip


def _late_times(unsent: Unsent) -> tuple[int, int]:
    """A published delivery's row ends as its publishing statement starts: its span ends
    with that statement (the publish child inside it)."""
    ended = unsent.ended_at or unsent.superseded_at or unsent.started_at
    publishing_ns = int((unsent.publish_ms or 0.0) * 1e6) if unsent.outcome == "published" else 0
    return int(unsent.started_at.timestamp() * 1e9), int(ended.timestamp() * 1e9) + publishing_ns


def _late_error(unsent: Unsent) -> tuple[str, str] | None:
    if unsent.ended_at is None:
        return WorkerDiedError.code, "the worker died before this delivery ended; written late"
    if unsent.error_code is None:
        return None
    return unsent.error_code, unsent.error or ""


def _attributes(
    stream: str, group: str, entry_id: str, lane: str, photo_id: str, tenant: str, outcome: str
) -> dict[str, Any]:
    """The live span's, but what its delivery took along (its delivery count)."""
    attributes = tracing.messaging(stream, group, entry_id) | {
        "darkroom.lane": lane,
        "darkroom.photo_id": photo_id,
        "darkroom.outcome": outcome,
    }
    if lane == "bulk" and tenant:
        attributes["darkroom.tenant"] = tenant
    return attributes


def _span_id(stored: str) -> int | None:
    """The column's span id, None when it is not one (16 hex digits, not all zero)."""
    try:
        span_id = int(stored, 16) if len(stored) == 16 else 0
    except ValueError:
        return None
    return span_id or None
