"""darkroom's OTLP encoder writes what the SDK's encoder writes, byte for byte, for every kind
of span, attribute, event, link and status; and the exporter built on it sends those bytes
to a real OTLP/HTTP receiver over loopback, and reports a receiver that is away."""

from __future__ import annotations

import logging
import socket
from http import HTTPStatus

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from darkroom import otlpwire
from tests.otlp import serving

TRACE, PARENT = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
RESOURCE = Resource({"service.name": "darkroom", "host.name": "ünïcode", "pid": 7})
OTHER = Resource({"service.name": "other"}, schema_url="https://opentelemetry.io/schemas/1.21.0")
SCOPE = InstrumentationScope("darkroom", "1.2", "https://example.com/schema", {"a": "b"})


def context(span_id: int, remote: bool = False, state: TraceState | None = None) -> SpanContext:
    return SpanContext(TRACE, span_id, remote, TraceFlags(TraceFlags.SAMPLED), state)


def made(name: str, span_id: int, **kwargs: object) -> ReadableSpan:
    defaults: dict[str, object] = {
        "resource": RESOURCE, "instrumentation_scope": SCOPE,
        "start_time": 1_700_000_000_123_456_789, "end_time": 1_700_000_000_223_456_789,
    }  # fmt: skip
    return ReadableSpan(name, context(span_id), **(defaults | kwargs))  # type: ignore[arg-type]


ATTRIBUTES: dict[str, object] = {
    "text": "photo ünïcode ✓", "empty": "", "yes": True, "no": False, "zero": 0, "small": 7,
    "negative": -3, "int64 max": 2**63 - 1, "int64 min": -(2**63), "large": 300, "pi": 3.14159,
    "negative float": -0.0, "bytes": b"\x00\xff", "strings": ("a", "", "ü"),
    "ints": [1, -1, 2**40], "bools": [True, False], "floats": (0.5,), "none": None,
    "nothing": (), "mapping": {"k": "v", "n": 1}, "": "keyless",
}  # fmt: skip


def spans() -> list[ReadableSpan]:
    """A batch with every field darkroom's spans and the SDK's may carry."""
    error = Status(StatusCode.ERROR, "corrupt_image: the file ends early ü")
    return [
        made("darkroom.process", 1, parent=context(PARENT, remote=True,
             state=TraceState([("vendor", "x1"), ("other", "y")])), kind=SpanKind.CONSUMER,
             attributes=ATTRIBUTES, status=error,
             events=(Event("exception", {"exception.type": "corrupt_image"}, 1_700_000_000_2),
                     Event("bare", None, 0)),
             links=(Link(context(9, remote=True), {"why": "reclaimed"}), Link(context(10)))),
        made("darkroom.claim", 2, parent=context(1)),
        made("root", 3, kind=SpanKind.PRODUCER, status=Status(StatusCode.OK)),
        made("darkroom.render", 4, parent=context(1), attributes={"darkroom.rendition": "large"}),
        made("open", 5, end_time=None, start_time=None),
        made("", 6, status=Status(StatusCode.UNSET)),
        made("other resource", 7, resource=OTHER),
        made("no scope", 8, instrumentation_scope=None),
        made("server", 11, kind=SpanKind.SERVER), made("client", 12, kind=SpanKind.CLIENT),
    ]  # fmt: skip


def test_the_bytes_are_the_sdk_encoders() -> None:
    batch = spans()
    ours, theirs = otlpwire.request(batch), encode_spans(batch).SerializePartialToString()
    assert ExportTraceServiceRequest.FromString(ours) == ExportTraceServiceRequest.FromString(
        theirs
    )
    assert ours == theirs
    parsed = ExportTraceServiceRequest.FromString(ours)
    assert len(parsed.resource_spans) == 2  # grouped by resource, then by scope
    assert [len(r.scope_spans) for r in parsed.resource_spans] == [2, 1]
    process = parsed.resource_spans[0].scope_spans[0].spans[0]
    assert process.status.message.endswith("ü") and process.flags == 0x300  # a remote parent
    values = {a.key: a.value for a in process.attributes}
    assert (
        values["int64 min"].int_value == -(2**63)
        and values["no"].WhichOneof("value") == "bool_value"
    )


def test_spans_made_by_the_tracer_encode_the_same() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("darkroom")
    with tracer.start_as_current_span(
        "outer", kind=SpanKind.CONSUMER, attributes={"n": 1}
    ) as outer:
        outer.add_event("note", {"k": [1, 2]})
        with tracer.start_as_current_span("inner") as inner:
            inner.set_status(Status(StatusCode.ERROR, "boom"))
    batch = memory.get_finished_spans()
    assert otlpwire.request(batch) == encode_spans(batch).SerializePartialToString()


def test_a_value_otlp_cannot_hold_is_left_out_and_logged_as_the_sdk_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    odd = {"kept": "yes", "object": object(), "too large": 2**64, "lone surrogate": "\ud800"}
    batch = [made("odd", 1, attributes=odd)]
    with caplog.at_level(logging.ERROR):
        ours = otlpwire.request(batch)
    theirs = encode_spans(batch).SerializePartialToString()
    assert ours == theirs
    kept = ExportTraceServiceRequest.FromString(ours).resource_spans[0].scope_spans[0].spans[0]
    assert [a.key for a in kept.attributes] == ["kept"]
    logged = [r.getMessage() for r in caplog.records if r.name == "darkroom.tracing"]
    assert len(logged) == 3 and all(m.startswith("Failed to encode key") for m in logged)


class Unequal(int):
    """An int that may not be compared for equality: checking it against a range by
    membership would (and, on an IntEnum, walk the range without end)."""

    def __eq__(self, other: object) -> bool:
        raise AssertionError("compared for equality")

    __hash__ = int.__hash__


@pytest.mark.timeout(20, method="thread")  # a range walk in C does not see the signal method
def test_an_int_subclass_equal_objects_and_reordered_resources_encode_as_the_sdk_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An int subclass (an IntEnum) is an int64 like any int; a resource or scope equal to one
    encoded before ({"flag": 1} == {"flag": True}, or the same attributes in another order)
    is encoded from its own attributes, not from the earlier one's bytes."""
    monkeypatch.setattr(otlpwire, "_kept", {})
    batches = [
        [made("unequal", 6, attributes={"n": Unequal(5)})],
        [made("status", 1, attributes={"http.response.status_code": HTTPStatus.OK})],
        [made("one", 2, instrumentation_scope=InstrumentationScope("s", "1", None, {"f": 1}))],
        [made("true", 3, instrumentation_scope=InstrumentationScope("s", "1", None, {"f": True}))],
        [made("ab", 4, resource=Resource({"a": 1, "b": 2}))],
        [made("ba", 5, resource=Resource({"b": 2, "a": 1}))],
    ]
    for batch in batches:
        assert otlpwire.request(batch) == encode_spans(batch).SerializePartialToString()


def test_short_lived_and_changed_resources_are_never_encoded_from_stale_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resources made and dropped one after another (their ids reused) and one whose mapping
    value changed in place after its first export each encode from their attributes now."""
    monkeypatch.setattr(otlpwire, "_kept", {})
    for i in range(200):
        batch = [made("short-lived", 1, resource=Resource({"flag": 1 if i % 2 else True}))]
        assert otlpwire.request(batch) == encode_spans(batch).SerializePartialToString()
    changing = Resource({"m": {"k": 1}})
    for value in (1, 2):
        changing.attributes["m"]["k"] = value  # type: ignore[index]
        batch = [made("changed", 2, resource=changing)]
        assert otlpwire.request(batch) == encode_spans(batch).SerializePartialToString()


def test_the_exporter_sends_the_bytes_to_a_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = spans()
    with serving() as got:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{got.endpoint}/v1/traces")
        exporter = otlpwire.exporter()
        assert exporter.lean(), "the locked SDK's exporter no longer has the client it reaches"
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        exporter.shutdown()
    assert got.exports == 1 and got.paths == ["/v1/traces"]
    assert got.export_bytes == len(encode_spans(batch).SerializePartialToString())
    assert sorted(s.name for s in got.spans) == sorted(s.name for s in batch)
    process = next(s for s in got.spans if s.name == "darkroom.process")
    assert process.parent_id == format(PARENT, "016x") and process.status == StatusCode.ERROR.value


def test_a_receiver_that_is_away_is_a_failed_export(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    exporter = otlpwire.exporter()
    assert exporter.export(spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert exporter.export(spans()) is SpanExportResult.FAILURE  # after shutdown, as the SDK's


def test_a_batch_the_encoder_cannot_write_goes_through_the_sdks_export(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A span the SDK encodes and this encoder does not (no status) is sent all the same; one
    neither can encode (a negative start) is a failed export, not an exception."""
    monkeypatch.setattr(otlpwire, "_fell_back", False)
    caplog.set_level(logging.WARNING, logger="darkroom.tracing")
    with serving() as got:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{got.endpoint}/v1/traces")
        exporter = otlpwire.exporter()
        no_status = made("no status", 1, status=None)
        assert exporter.export([no_status]) is SpanExportResult.SUCCESS
        assert exporter.export([made("before 1970", 2, start_time=-1)]) is SpanExportResult.FAILURE
        exporter.shutdown()
    assert [s.name for s in got.spans] == ["no status"]
    said = [r.getMessage() for r in caplog.records if r.name == "darkroom.tracing"]
    assert len(said) == 1 and said[0].startswith("spans sent through the SDK's encoder")
