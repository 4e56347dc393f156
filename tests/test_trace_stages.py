"""A delivery's stage spans as darkroom makes them (stagespans.py: ended spans handed to the
span processor, not the tracer's), in-process with the SDK's in-memory exporter: the same
trace, parents, errors and grouping the tracer's spans would have, and the stage named by an
exemplar, a log line and the context sent to the render process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from darkroom import stagespans, tracing
from darkroom.errors import StorageUnavailableError
from darkroom.image.stagetimes import Stage
from darkroom.queue.messages import Entry
from tests.otlp import producer_span


@pytest.fixture
def memory() -> Iterator[Any]:
    """Tracing on into memory, as `tracing.start` would set it up but for the exporter."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=tracing._hashed(Resource.create({"service.name": "t"})))
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    tracing.use(provider, processor)
    try:
        yield exporter
    finally:
        tracing.use(None, None)


def delivered(carrier: dict[str, str]) -> Entry:
    return Entry("1700000000000-0", {"photo_id": "p", **carrier})


def failed_download(exporter: Any, message: str) -> Any:
    """A traced delivery whose download stage fails; the stage's span."""
    _, _, carrier = producer_span()
    with (
        tracing.delivery(delivered(carrier), 1, "s", "g"),
        pytest.raises(StorageUnavailableError),
        tracing.span("download"),
    ):
        raise StorageUnavailableError(message)
    [download] = [s for s in exporter.get_finished_spans() if s.name == "darkroom.download"]
    return download


def test_stages_are_children_of_the_delivery_in_the_producers_trace(memory: Any) -> None:
    """The queue wait, each stage and the render process's stages: one trace, the delivery's
    children (the render's stages the render's), each inside its parent's time."""
    trace_id, parent_id, carrier = producer_span()
    with tracing.delivery(delivered(carrier), 1, "s", "g"):
        with tracing.span("claim"):
            pass
        with tracing.span("render"):
            at = stagespans.current.get()
            assert at is not None
            t0 = at.start_ns
            tracing.rendered(
                [Stage("decode", t0, t0 + 5, ""), Stage("encode", t0 + 5, t0 + 9, "thumb")]
            )
    spans = {s.name: s for s in memory.get_finished_spans()}
    process = spans["darkroom.process"]
    assert {s.context.trace_id for s in spans.values()} == {int(trace_id, 16)}
    assert process.parent.span_id == int(parent_id, 16)
    for name in ("darkroom.queue_wait", "darkroom.claim", "darkroom.render"):
        assert spans[name].parent.span_id == process.context.span_id, name
    render = spans["darkroom.render"]
    assert spans["darkroom.decode"].parent.span_id == render.context.span_id
    assert spans["darkroom.encode"].attributes["darkroom.rendition"] == "thumb"
    assert spans["darkroom.queue_wait"].start_time == 1_700_000_000_000 * 1_000_000
    for name in ("darkroom.claim", "darkroom.render"):
        assert process.start_time <= spans[name].start_time <= spans[name].end_time
        assert spans[name].end_time <= process.end_time
    assert len({s.context.span_id for s in spans.values()}) == len(spans) == 6


def test_a_stage_left_by_an_error_carries_its_stable_code(memory: Any) -> None:
    """Status ERROR, `error.type` the code, an `exception` event with the message: what the
    tracer's spans get from `record_error`."""
    download = failed_download(memory, "S3 down")
    assert download.status.status_code.name == "ERROR"
    assert download.status.description == "storage_unavailable: S3 down"
    assert download.attributes["error.type"] == "storage_unavailable"
    [event] = download.events
    thrown = {"exception.type": "storage_unavailable", "exception.message": "S3 down"}
    assert (event.name, dict(event.attributes)) == ("exception", thrown)


def test_inside_a_stage_exemplars_logs_and_the_render_context_name_it(memory: Any) -> None:
    """A histogram observed, a line logged or a render started inside a stage points at that
    stage's span, as when the stage was the current span."""
    trace_id, _, carrier = producer_span()
    with tracing.delivery(delivered(carrier), 1, "s", "g"), tracing.span("render"):
        stage = stagespans.current.get()
        assert stage is not None
        span_id = format(stage.context.span_id, "016x")
        assert tracing.exemplar() == {"trace_id": trace_id, "span_id": span_id}
        assert tracing.log_ids(None, "info", {}) == {"trace_id": trace_id, "span_id": span_id}
        flags = format(stage.context.trace_flags, "02x")  # sampled, as the delivery is
        assert tracing.injected()["traceparent"] == f"00-{trace_id}-{span_id}-{flags}"
        assert int(flags, 16) & 1
    assert stagespans.current.get() is None


def test_no_stage_span_outside_a_recording_span(memory: Any) -> None:
    """A stage with no delivery around it, or under an unsampled producer's context, makes no
    span (it would be a trace of no photo's); the code inside runs all the same."""
    ran = []
    with tracing.span("ack"):
        ran.append("ack")
        assert not tracing.recording()
    _, _, carrier = producer_span()
    unsampled = {"traceparent": carrier["traceparent"][:-2] + "00"}
    with tracing.delivery(delivered(unsampled), 1, "s", "g"), tracing.span("claim"):
        ran.append("claim")
        assert not tracing.recording()  # so the render process times no stage either
    assert ran == ["ack", "claim"] and memory.get_finished_spans() == ()
    with tracing.delivery(delivered(carrier), 1, "s", "g"):
        assert tracing.recording()


def test_stages_encode_with_the_tracers_spans_under_one_resource_and_scope(memory: Any) -> None:
    """The exporter groups a batch by resource and scope: the stages join the delivery's
    span in one ScopeSpans, as spans of one tracer."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    _, _, carrier = producer_span()
    with tracing.delivery(delivered(carrier), 1, "s", "g"), tracing.span("claim"):
        pass
    request = encode_spans(memory.get_finished_spans())
    [resource_spans] = request.resource_spans
    [scope_spans] = resource_spans.scope_spans
    assert scope_spans.scope.name == "darkroom"
    assert {s.name for s in scope_spans.spans} == {
        "darkroom.process", "darkroom.queue_wait", "darkroom.claim"}  # fmt: skip


def test_notes_reach_the_delivery_span_as_it_ends(memory: Any) -> None:
    """Notes are kept and set once on the delivery's span as it ends (a later one of the same
    name wins); with an error's own attributes beside them; outside a delivery, none."""
    _, _, carrier = producer_span()
    tracing.note(outcome="nowhere")  # no delivery: nothing to note on
    with tracing.delivery(delivered(carrier), 1, "s", "g"):
        tracing.note(attempt=2, claim="claimed")
        tracing.note(outcome="retrying")
        tracing.failed("storage_unavailable", "S3 down")
        tracing.note(outcome="failed")
    [process] = [s for s in memory.get_finished_spans() if s.name == "darkroom.process"]
    code = "storage_unavailable"
    expected = {"darkroom.attempt": 2, "darkroom.claim": "claimed", "darkroom.outcome": "failed",
                "darkroom.error_code": code, "error.type": code}  # fmt: skip
    assert {k: process.attributes[k] for k in expected} == expected


def test_a_stages_error_text_keeps_the_attribute_length_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT cuts a stage's error code and message as it cuts a
    tracer's span's."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "10")
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    tracing.use(provider, processor)
    try:
        download = failed_download(exporter, "a message longer than ten")
    finally:
        tracing.use(None, None)
    assert download.attributes["error.type"] == "storage_un"
    assert dict(download.events[0].attributes) == {
        "exception.type": "storage_un", "exception.message": "a message "}  # fmt: skip


def test_flush_exports_what_the_provider_in_use_holds() -> None:
    """`flush` flushes the provider `use` installed (not whichever is global): a batched
    span is exported by the time it returns."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    processor = BatchSpanProcessor(exporter, schedule_delay_millis=60_000)
    provider.add_span_processor(processor)
    tracing.use(provider, processor)
    try:
        _, _, carrier = producer_span()
        with tracing.delivery(delivered(carrier), 1, "s", "g"), tracing.span("claim"):
            pass
        assert exporter.get_finished_spans() == ()  # still in the batch
        assert tracing.flush()
    finally:
        tracing.use(None, None)
        provider.shutdown()
    assert {s.name for s in exporter.get_finished_spans()} == {
        "darkroom.process", "darkroom.queue_wait", "darkroom.claim"}  # fmt: skip
