"""OpenTelemetry traces through the queue, from real worker processes to a loopback OTLP/HTTP
receiver that decodes what they export: one trace per photo from its producer's span, across
a retry, a reclaim after SIGKILL, the sweep and a dead-letter replay, through the bulk feeder
and from a PostgreSQL-only row; and no trace SDK loaded when off."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from darkroom import spanwriter, tracing
from darkroom.errors import BadMessageError
from darkroom.queue.messages import parse_task, received, task_fields, trace_fields
from darkroom.store import leases
from tests.conftest import PHOTOS, Env
from tests.otlp import Receiver, Span, producer_span, serving
from tests.test_recovery import HEIC, kill_mid_photo, log_lines, wait_for

PHOTO = PHOTOS / "4.webp"
STAGES = {"darkroom.queue_wait", "darkroom.claim", "darkroom.download", "darkroom.render",
          "darkroom.upload", "darkroom.publish", "darkroom.ack"}  # fmt: skip


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A test OTLP/HTTP receiver on a loopback port: POST /v1/traces, protobuf."""
    with serving() as got:
        yield got


def otel(receiver: Receiver, **extra: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "darkroom-test", **extra}  # fmt: skip


def add_photo(
    env: Env, lane: str = "interactive", photo: Path = PHOTO, **columns: Any
) -> uuid.UUID:
    """A photo as a PostgreSQL-only producer stores it: the original in storage and its row
    (enqueued_at NULL: nobody XADDed it yet)."""
    photo_id = uuid.uuid4()
    folder = env.tmp / "var" / "storage" / "originals" / str(photo_id)
    folder.mkdir(parents=True)
    shutil.copy(photo, folder / photo.name)
    names = ", ".join(["id", "original_key", "lane", *columns])
    values = ", ".join(f"${n}" for n in range(1, 4 + len(columns)))
    env.query(f"INSERT INTO photos ({names}) VALUES ({values}) RETURNING id", photo_id,
              f"originals/{photo_id}/{photo.name}", lane, *columns.values())  # fmt: skip
    return photo_id


def xadd(env: Env, photo_id: uuid.UUID, carrier: dict[str, str]) -> str:
    """The producer's XADD after its insert, with its trace context and a field of its own."""
    env.query("UPDATE photos SET enqueued_at = now() WHERE id = $1 RETURNING id", photo_id)
    env.redis.xgroup_create(env.stream, "darkroom", id="0", mkstream=True)
    fields = {**task_fields(photo_id), **carrier, "source": "tests"}
    return str(env.redis.xadd(env.stream, fields))  # type: ignore[arg-type]


def process_spans(receiver: Receiver, trace_id: str) -> list[Span]:
    spans = [s for s in receiver.of_trace(trace_id) if s.name == "darkroom.process"]
    # a killed delivery's span, written at its reclaim, has no delivery count: first
    return sorted(spans, key=lambda s: s.attributes.get("darkroom.delivery_count", 0))


def test_a_photo_xadded_with_a_traceparent_is_one_trace_from_the_producer(
    file_env: Env, receiver: Receiver
) -> None:
    """The consumer span is the producer span's child, its stages its own, all one trace."""
    trace_id, producer_id, carrier = producer_span()
    photo_id = add_photo(file_env)
    entry_id = xadd(file_env, photo_id, carrier)
    log = file_env.cli("run", "--drain", **otel(receiver)).stderr
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    [process] = process_spans(receiver, trace_id)
    assert process.parent_id == producer_id and process.kind == 5  # SPAN_KIND_CONSUMER
    assert process.service == "darkroom-test"
    assert {k: process.attributes.get(k) for k in (
        "messaging.system", "messaging.destination.name", "messaging.message.id",
        "darkroom.lane", "darkroom.attempt", "darkroom.delivery_count", "darkroom.outcome",
    )} == {"messaging.system": "redis", "messaging.destination.name": file_env.stream,
           "messaging.message.id": entry_id, "darkroom.lane": "interactive",
           "darkroom.attempt": 1, "darkroom.delivery_count": 1,
           "darkroom.outcome": "published"}  # fmt: skip
    children = {s.name for s in receiver.of_trace(trace_id) if s.parent_id == process.span_id}
    assert children == STAGES
    # stored on the row when first seen, so a later hop can carry it; the event carries it
    [row] = file_env.query("SELECT traceparent FROM photos WHERE id = $1", photo_id)
    assert row["traceparent"] == carrier["traceparent"]
    [(_, event)] = file_env.redis.xrange(file_env.vars["DARKROOM_EVENTS_STREAM"])
    document = json.loads(next(iter(event.values())))
    assert document["subject"] == str(photo_id)
    assert document["traceparent"] == carrier["traceparent"]
    done = [line for line in log_lines(log) if line.get("event") == "entry done"]
    assert [line.get("trace_id") for line in done] == [trace_id]


def test_a_retry_after_a_transient_failure_stays_in_the_photos_trace(
    file_env: Env, receiver: Receiver
) -> None:
    """A failed first attempt and the attempt that publishes are two spans of one trace."""
    trace_id, producer_id, carrier = producer_span()
    photo_id = add_photo(file_env)
    original = file_env.tmp / "var" / "storage" / "originals" / str(photo_id) / PHOTO.name
    original.unlink()
    original.mkdir()  # reading a directory is an I/O error: storage_unavailable, retried
    xadd(file_env, photo_id, carrier)
    worker = file_env.start("run", DARKROOM_MAX_ATTEMPTS="5", DARKROOM_RETRY_BASE_MS="1000",
                            DARKROOM_CLAIM_IDLE_MS="1000", **otel(receiver))  # fmt: skip
    wait_for(file_env, "SELECT 1 FROM photo_jobs WHERE photo_id = $1 AND state = 'pending'"
             " AND error_code = 'storage_unavailable'", photo_id, proc=worker)  # fmt: skip
    original.rmdir()
    shutil.copy(PHOTO, original)
    wait_for(file_env, "SELECT 1 FROM photos WHERE id = $1 AND processing_state = 'processed'",
             photo_id, proc=worker)  # fmt: skip
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    spans = process_spans(receiver, trace_id)
    assert len(spans) >= 2 and all(s.parent_id == producer_id for s in spans)
    first, last = spans[0], spans[-1]
    assert first.attributes["error.type"] == "storage_unavailable"
    assert first.attributes["darkroom.outcome"] == "retrying" and first.status == 2  # ERROR
    assert last.attributes["darkroom.outcome"] == "published"
    assert last.attributes["darkroom.attempt"] == len(spans)
    # each try in place is a download span of the attempt's, each with the error's code
    downloads = [s for s in receiver.of_trace(trace_id)
                 if s.name == "darkroom.download" and s.parent_id == first.span_id]  # fmt: skip
    assert {s.attributes.get("error.type") for s in downloads} == {"storage_unavailable"}


def test_postgres_only_rows_with_a_traceparent_column_join_their_trace_through_the_feeder(
    file_env: Env, receiver: Receiver
) -> None:
    """A bulk row and an interactive row nobody XADDed: the feeder's entries carry the
    column's context, so each photo's consumer span is its producer's child."""
    bulk_trace, bulk_parent, bulk_carrier = producer_span()
    row_trace, row_parent, row_carrier = producer_span()
    bulk = add_photo(file_env, "bulk", tenant="acme", traceparent=bulk_carrier["traceparent"])
    interactive = add_photo(file_env, traceparent=row_carrier["traceparent"])
    file_env.cli("run", "--drain", **otel(receiver))
    [fed] = process_spans(receiver, bulk_trace)
    assert fed.parent_id == bulk_parent
    assert fed.attributes["darkroom.lane"] == "bulk"
    assert fed.attributes["darkroom.tenant"] == "acme"
    assert fed.attributes["messaging.destination.name"] == f"{file_env.stream}:bulk"
    assert fed.attributes["darkroom.photo_id"] == str(bulk)
    [taken] = process_spans(receiver, row_trace)
    assert taken.parent_id == row_parent and taken.attributes["darkroom.photo_id"] == str(
        interactive
    )
    assert {fed.attributes["darkroom.outcome"], taken.attributes["darkroom.outcome"]} == {
        "published"
    }


def test_a_delivery_reclaimed_after_its_worker_was_killed_stays_in_the_photos_trace(
    file_env: Env, receiver: Receiver
) -> None:
    """SIGKILL mid-photo: the worker that reclaims the entry makes its span in the same
    trace, the producer's child, as the photo's second delivery and attempt."""
    trace_id, producer_id, carrier = producer_span()
    xadd(file_env, add_photo(file_env, photo=HEIC), carrier)
    settings = {"DARKROOM_CLAIM_IDLE_MS": "1500", **otel(receiver)}
    kill_mid_photo(file_env, settings)
    file_env.cli("run", "--drain", **settings)
    reclaimed = process_spans(receiver, trace_id)[-1]
    assert reclaimed.parent_id == producer_id
    assert reclaimed.attributes["darkroom.delivery_count"] == 2
    assert reclaimed.attributes["darkroom.attempt"] == 2
    assert reclaimed.attributes["darkroom.outcome"] == "published"


def test_the_reclaiming_delivery_writes_the_killed_deliverys_span_worker_died(
    file_env: Env, receiver: Receiver
) -> None:
    """A delivery SIGKILLed after its claim never ends its span; the delivery that reclaims
    the job writes it: the span id its claim kept on the attempt row, the producer's child,
    from the row's start to the reclaim, status ERROR `worker_died`. So whatever stages the
    dead delivery had exported hang from it, and the trace has both attempts."""
    trace_id, producer_id, carrier = producer_span()
    photo_id = add_photo(file_env, photo=HEIC)
    entry_id = xadd(file_env, photo_id, carrier)
    settings = {"DARKROOM_CLAIM_IDLE_MS": "1500", **otel(receiver)}
    kill_mid_photo(file_env, settings)
    [dead_row] = file_env.query("SELECT span_id, started_at FROM photo_attempts"
                                " WHERE photo_id = $1", photo_id)  # fmt: skip
    assert dead_row["span_id"] is not None and len(dead_row["span_id"]) == 16
    file_env.cli("run", "--drain", **settings)
    spans = {s.span_id: s for s in receiver.of_trace(trace_id)}
    dead = spans[dead_row["span_id"]]
    assert (dead.name, dead.kind, dead.parent_id) == ("darkroom.process", 5, producer_id)
    assert dead.status == 2 and dead.attributes["error.type"] == "worker_died"
    assert {k: dead.attributes.get(k) for k in (
        "darkroom.error_code", "darkroom.outcome", "darkroom.attempt", "darkroom.lane",
        "messaging.message.id", "messaging.destination.name", "darkroom.photo_id",
    )} == {"darkroom.error_code": "worker_died", "darkroom.outcome": "worker_died",
           "darkroom.attempt": 1, "darkroom.lane": "interactive",
           "messaging.message.id": entry_id, "messaging.destination.name": file_env.stream,
           "darkroom.photo_id": str(photo_id)}  # fmt: skip
    assert dead.start_ns == int(dead_row["started_at"].timestamp() * 1e9) < dead.end_ns
    [reclaimed] = [s for s in spans.values()
                   if s.name == "darkroom.process" and s is not dead]  # fmt: skip
    assert reclaimed.attributes["darkroom.attempt"] == 2
    assert reclaimed.attributes["darkroom.outcome"] == "published"
    assert dead.end_ns <= reclaimed.end_ns
    # every span of the trace reaches the producer's: nothing hangs from a missing parent
    assert all(s.parent_id in spans or s.parent_id == producer_id for s in spans.values())


def test_a_dead_deliverys_span_keeps_its_id_and_joins_only_the_photos_trace() -> None:
    """In-process, the SDK's own pipeline to memory: the span gets the row's id, the photo's
    traceparent as parent, the bulk tenant; the next span a random id again. No span for a
    photo without a trace context, nor for a span id that is not one."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(id_generator=tracing._preset_ids())
    processor = SimpleSpanProcessor(memory)
    provider.add_span_processor(processor)
    trace_id, parent_id, carrier = producer_span()
    started = datetime.now(UTC) - timedelta(seconds=3)
    died = leases.Died("00f067aa0ba902b7", started, "1-0", "bulk", 2, "acme",
                       carrier["traceparent"])  # fmt: skip
    tracing.use(provider, processor)
    try:
        spanwriter.worker_died(died, "s:bulk", "g", "p")
        spanwriter.worker_died(replace(died, traceparent=None), "s:bulk", "g", "p")
        spanwriter.worker_died(replace(died, span_id="not a span id!!"), "s:bulk", "g", "p")
        tracing.tracer().start_span("after").end()
    finally:
        tracing.use(None, None)
    dead, after = memory.get_finished_spans()
    ids = (dead.context.trace_id, dead.context.span_id, dead.parent.span_id)
    assert ids == (int(trace_id, 16), 0x00F067AA0BA902B7, int(parent_id, 16))
    assert dead.start_time == int(started.timestamp() * 1e9) < dead.end_time
    assert dead.status.status_code.name == "ERROR"
    assert {k: dead.attributes[k] for k in ("darkroom.tenant", "darkroom.attempt",
            "messaging.destination.name", "error.type")} == {
        "darkroom.tenant": "acme", "darkroom.attempt": 2,
        "messaging.destination.name": "s:bulk", "error.type": "worker_died"}  # fmt: skip
    assert after.context.span_id != dead.context.span_id


def test_a_photo_whose_entry_was_lost_is_swept_back_into_its_trace(
    file_env: Env, receiver: Receiver
) -> None:
    """A row XADDed long ago whose entry Redis lost: the sweep's entry carries the row's
    traceparent, so the delivery it brings is still the producer's child."""
    trace_id, producer_id, carrier = producer_span()
    long_ago = datetime.now(UTC) - timedelta(seconds=30)
    add_photo(file_env, traceparent=carrier["traceparent"], enqueued_at=long_ago,
              last_activity_at=long_ago)  # fmt: skip
    file_env.redis.xgroup_create(file_env.stream, "darkroom", id="0", mkstream=True)
    file_env.cli("run", "--drain", DARKROOM_SWEEP_AFTER_S="1", **otel(receiver))
    [swept] = process_spans(receiver, trace_id)
    assert swept.parent_id == producer_id
    assert swept.attributes["darkroom.outcome"] == "published"


def test_a_dead_letter_replayed_after_the_fix_continues_the_photos_trace(
    file_env: Env, receiver: Receiver
) -> None:
    """The failed delivery and the one after `dlq replay` are both children of the producer."""
    trace_id, producer_id, carrier = producer_span()
    photo_id = add_photo(file_env)
    original = file_env.tmp / "var" / "storage" / "originals" / str(photo_id) / PHOTO.name
    original.write_bytes(b"not an image at all")
    xadd(file_env, photo_id, carrier)
    file_env.cli("run", "--drain", **otel(receiver))
    [(_, letter)] = file_env.redis.xrange(file_env.dead)
    assert letter["traceparent"] == carrier["traceparent"]
    shutil.copy(PHOTO, original)
    file_env.cli("dlq", "replay")
    file_env.cli("run", "--drain", **otel(receiver))
    failed, replayed = sorted(
        process_spans(receiver, trace_id), key=lambda s: s.attributes["messaging.message.id"]
    )
    assert failed.parent_id == replayed.parent_id == producer_id
    assert failed.attributes["error.type"] == "unsupported_format"
    assert failed.attributes["darkroom.outcome"] == "failed"
    assert replayed.attributes["darkroom.outcome"] == "published"


def test_ingest_traces_its_photos_when_tracing_is_on(file_env: Env, receiver: Receiver) -> None:
    """`darkroom ingest` makes a producer span per photo; the worker's span is its child."""
    [photo_id] = [
        uuid.UUID(x) for x in file_env.cli("ingest", str(PHOTO), **otel(receiver)).stdout.split()
    ]
    file_env.cli("run", "--drain", **otel(receiver))
    [ingest] = receiver.named("darkroom.ingest")
    assert ingest.kind == 4 and ingest.attributes["darkroom.photo_id"] == str(photo_id)  # PRODUCER
    [process] = process_spans(receiver, ingest.trace_id)
    assert process.parent_id == ingest.span_id


# What darkroom's tracing would load: the trace SDK, the exporter, the W3C propagator. (redis-py
# loads OpenTelemetry's metrics SDK itself whenever it is installed, for an observability of
# its own that stays off unless configured: docs/tracing.md.)
WORKER_THEN_MODULES = """
import sys
from darkroom import cli, tracing
code = cli.main(["run", "--drain"])
ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.propagators",
        "opentelemetry.trace.propagation.tracecontext")
print(tracing.on(), sorted(m for m in sys.modules if m.startswith(ours)))
sys.exit(code)
"""


@pytest.mark.parametrize("disabled", [None, "true"])
def test_a_worker_with_tracing_off_never_imports_the_trace_sdk(
    file_env: Env, receiver: Receiver, disabled: str | None
) -> None:
    """No endpoint, or OTEL_SDK_DISABLED=true: a worker processes a traced entry without
    loading OpenTelemetry's trace SDK, exporter or propagator, and exports nothing."""
    _, _, carrier = producer_span()
    photo_id = add_photo(file_env)
    xadd(file_env, photo_id, carrier)
    extra = otel(receiver, OTEL_SDK_DISABLED=disabled) if disabled else {}
    environ = file_env.environ(**extra)
    if not disabled:
        environ = {k: v for k, v in environ.items() if not k.startswith("OTEL_")}
    command = [sys.executable, "-c", WORKER_THEN_MODULES]
    done = subprocess.run(command, env=environ, cwd=file_env.tmp, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False []"
    [row] = file_env.query(
        "SELECT processing_state, traceparent FROM photos WHERE id = $1", photo_id
    )
    assert row["processing_state"] == "processed"
    assert row["traceparent"] == carrier["traceparent"]  # carried forward all the same
    assert receiver.spans == []


def test_trace_fields_are_tolerated_never_a_bad_message() -> None:
    """A malformed traceparent is ignored (the photo is processed untraced); a valid one is
    parsed; both stay among the entry's tolerated fields."""
    photo_id = uuid.uuid4()
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for value, expected in ((good, good), ("not-a-traceparent", None), ("ff" + good[2:], None)):
        entry = received("1-0", [b"photo_id", str(photo_id).encode(), b"traceparent",
                                 value.encode(), b"tracestate", b"k=v"])  # fmt: skip
        assert parse_task(entry).traceparent == expected
    assert trace_fields({"traceparent": good, "tracestate": "k=v", "x": "y"}) == {
        "traceparent": good, "tracestate": "k=v"}  # fmt: skip
    with pytest.raises(BadMessageError):
        parse_task(received("1-0", [b"traceparent", good.encode()]))


def test_tracing_is_wanted_only_with_an_endpoint_and_not_disabled() -> None:
    """OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT turns tracing on; OTEL_SDK_DISABLED=true off."""
    endpoint = "http://127.0.0.1:4318"
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint + "/v1/traces"})
    assert not tracing.wanted(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SDK_DISABLED": "TRUE"}
    )
