"""The span batches (spanbatch.py): spans encoded by the thread that ends them, posted by the
export thread through the SDK's OTLP/HTTP exporter to a receiver that decodes what it gets;
batches leave as the standard OTEL_BSP_* variables say; a flush posts everything; a failed
post delivers nothing; a full queue drops new spans."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from darkroom import confirmations, spanbatch
from tests.otlp import Receiver, serving


def _provider(processor: Any) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": "batches"}))
    provider.add_span_processor(processor)
    return provider


def _exporter(receiver: Receiver) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces", timeout=2)


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving() as got:
        yield got


def _batches(receiver: Receiver, settings: spanbatch.Limits) -> tuple[Any, list[Any]]:
    """The processor posting to `receiver` through the OTLP exporter, the process spans it
    reported delivered."""
    delivered: list[Any] = []
    exporter = _exporter(receiver)
    processor = spanbatch.otlp(exporter, confirmations.process_ids, delivered.extend, settings)
    return processor, delivered


def _end(tracer: Any, count: int, name: str = "darkroom.stage") -> list[str]:
    ids = []
    for i in range(count):
        with tracer.start_as_current_span(name, attributes={"darkroom.photo_id": f"p{i}"}) as s:
            ids.append(format(s.get_span_context().span_id, "016x"))
    return ids


def test_every_span_reaches_the_receiver_whole_and_process_spans_are_confirmed(
    receiver: Receiver,
) -> None:
    """100 spans over several chunks, then a flush: all 100 decoded with their names,
    attributes and resource, in one request; each `darkroom.process` span confirmed."""
    processor, delivered = _batches(receiver, spanbatch.Limits(60.0, 2048, 512))
    tracer = _provider(processor).get_tracer("darkroom")
    stages = _end(tracer, 70)
    processes = _end(tracer, 30, "darkroom.process")
    assert processor.force_flush()
    assert {s.span_id for s in receiver.spans} == set(stages + processes)
    assert len(receiver.spans) == 100
    assert {s.service for s in receiver.spans} == {"batches"}
    assert receiver.exports == 1
    assert sorted(span for _, span in delivered) == sorted(processes)
    assert {photo for photo, _ in delivered} == {f"p{i}" for i in range(30)}


def test_the_thread_that_ends_the_spans_encodes_them(receiver: Receiver) -> None:
    """Full chunks are encoded by the ending thread; the export thread only posts."""
    encoders: list[str] = []
    encode, post = spanbatch.otlp_parts(_exporter(receiver))

    def encoding(spans: Any) -> bytes:
        encoders.append(threading.current_thread().name)
        return encode(spans)

    settings = spanbatch.Limits(60.0, 2048, 64)
    processor = spanbatch.EncodedBatches(encoding, post, list, print, settings)
    tracer = _provider(processor).get_tracer("darkroom")
    _end(tracer, 64)
    assert _wait_for(lambda: len(receiver.spans) == 64), "a whole batch leaves at once"
    assert encoders == [threading.current_thread().name] * 2
    processor.shutdown()


def test_a_batch_leaves_when_its_spans_wait_and_the_rest_at_the_delay(
    receiver: Receiver,
) -> None:
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans leave together without waiting for the delay;
    fewer leave at OTEL_BSP_SCHEDULE_DELAY, encoded by the export thread."""
    processor, _ = _batches(receiver, spanbatch.Limits(1.0, 2048, 64))
    tracer = _provider(processor).get_tracer("darkroom")
    _end(tracer, 64 + 5)
    assert _wait_for(lambda: len(receiver.spans) == 64, timeout_s=0.8)
    assert _wait_for(lambda: len(receiver.spans) == 69, timeout_s=5)
    assert receiver.exports == 2
    processor.shutdown()


def test_a_failed_post_confirms_nothing_and_says_so() -> None:
    """The collector away: the flush reports it, and no span is reported delivered."""
    delivered: list[Any] = []
    with serving() as gone:
        exporter = _exporter(gone)
    processor = spanbatch.otlp(exporter, confirmations.process_ids, delivered.extend)
    tracer = _provider(processor).get_tracer("darkroom")
    _end(tracer, 3, "darkroom.process")
    assert processor.force_flush() is False
    assert delivered == []


def test_a_full_queue_drops_new_spans_and_keeps_the_waiting_ones(receiver: Receiver) -> None:
    """Past OTEL_BSP_MAX_QUEUE_SIZE spans waiting (the collector slow), a new span is
    dropped; the queue's spans all leave once the post returns."""
    taken, release = threading.Event(), threading.Event()
    encode, post = spanbatch.otlp_parts(_exporter(receiver))

    def slow(data: bytes) -> bool:
        taken.set()
        return release.wait(10) and post(data)

    settings = spanbatch.Limits(60.0, 40, 40)
    processor = spanbatch.EncodedBatches(encode, slow, list, print, settings)
    tracer = _provider(processor).get_tracer("darkroom")
    first = _end(tracer, 40)  # a whole batch: the export thread posts it and blocks
    assert taken.wait(10)
    kept = _end(tracer, 40)
    dropped = _end(tracer, 5)
    release.set()
    assert processor.force_flush()
    got = {s.span_id for s in receiver.spans}
    assert got == set(first + kept)
    assert not got & set(dropped)


def test_only_sampled_spans_are_queued(receiver: Receiver) -> None:
    """A span whose context is not sampled (a stage under an unsampled parent) stays out."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    processor, _ = _batches(receiver, spanbatch.Limits(60.0, 2048, 512))
    for flags, span_id in ((TraceFlags.DEFAULT, 1), (TraceFlags.SAMPLED, 2)):
        processor.on_end(
            ReadableSpan("darkroom.stage", SpanContext(7, span_id, False, TraceFlags(flags)))
        )
    assert processor.force_flush()
    assert [s.span_id for s in receiver.spans] == [format(2, "016x")]


def test_shutdown_posts_what_waits_and_drops_what_ends_after(receiver: Receiver) -> None:
    processor, _ = _batches(receiver, spanbatch.Limits(60.0, 2048, 512))
    tracer = _provider(processor).get_tracer("darkroom")
    before = _end(tracer, 3)
    processor.shutdown()
    _end(tracer, 2)
    assert [s.span_id for s in receiver.spans] == before
    assert processor.force_flush() is False


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, spanbatch.Limits(5.0, 2048, 512)),
        (
            {
                "OTEL_BSP_SCHEDULE_DELAY": "250",
                "OTEL_BSP_MAX_QUEUE_SIZE": "100",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50",
            },
            spanbatch.Limits(0.25, 100, 50),
        ),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}, spanbatch.Limits(5.0, 100, 100)),
        (
            {"OTEL_BSP_SCHEDULE_DELAY": "soon", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "-1"},
            spanbatch.Limits(5.0, 2048, 512),
        ),
    ],
)
def test_limits_read_the_standard_variables(environ: dict[str, str], expected: Any) -> None:
    """As the SDK reads them: milliseconds; a batch no larger than the queue; a value that is
    not a positive number is the default."""
    assert spanbatch.limits(environ) == expected
