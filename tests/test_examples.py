"""The producer and consumer examples run against the real servers: the Python
(redis-py + asyncpg) and Node (ioredis + pg) producers make a photo darkroom processes, the
PostgreSQL-only producer leaves its row for the intake, both carry a producer's trace context
into darkroom's trace (the Node one its own OpenTelemetry span too), and both consumers
handle each event of `{darkroom}:events` once, however often it is delivered."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import PHOTOS, Env
from tests.test_tracing import Receiver, otel, process_spans, producer_span, receiver

__all__ = ["receiver"]  # the fixture, used by name

EXAMPLES = Path(__file__).parent.parent / "examples"
NODE = shutil.which("node")
PRODUCERS = {
    "python": [sys.executable, str(EXAMPLES / "python" / "produce.py")],
    "node": [str(NODE), str(EXAMPLES / "node" / "produce.js")],
}
CONSUMERS = {
    "python": [sys.executable, str(EXAMPLES / "python" / "consume.py"), "--idle-exit", "2"],
    "node": [str(NODE), str(EXAMPLES / "node" / "consume.js"), "--idle-exit", "2"],
}


def run(env: Env, command: list[str], **extra: str) -> str:
    if command[0] == str(NODE):
        assert (EXAMPLES / "node" / "node_modules").exists(), "make test runs npm ci there"
    done = subprocess.run(command, env=env.environ(**extra), cwd=env.tmp, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def events_stream(env: Env) -> str:
    return env.stream.replace(":photos", ":events")


def cloud_event(event_id: str, photo_id: str) -> str:
    """The documented shape (docs/events.md): CloudEvents 1.0, structured JSON."""
    return json.dumps({"specversion": "1.0", "id": event_id, "source": "darkroom",
                       "type": "darkroom.photo.published", "datacontenttype": "application/json",
                       "data": {"photo_id": photo_id}})  # fmt: skip


@pytest.mark.parametrize("language", ["python", "node"])
def test_the_producer_makes_a_photo_darkroom_processes(file_env: Env, language: str) -> None:
    """Original, row, XADD: `run --drain` then publishes the photo."""
    photo_id = uuid.UUID(run(file_env, [*PRODUCERS[language], str(PHOTOS / "4.webp")]).strip())
    (entry,) = file_env.redis.xrange(file_env.stream)
    assert entry[1] == {"photo_id": str(photo_id)}
    file_env.cli("run", "--drain")
    (row,) = file_env.query("SELECT processing_state FROM photos WHERE id = $1", photo_id)
    assert row["processing_state"] == "processed"


@pytest.mark.parametrize("language", ["python", "node"])
def test_a_producer_given_a_traceparent_puts_it_on_its_entry_and_row(
    file_env: Env, receiver: Receiver, language: str
) -> None:
    """TRACEPARENT set: the entry and the row carry it, and the traced worker's span of the
    photo is the producer's span's child, in its trace."""
    trace_id, producer_id, carrier = producer_span()
    command = [*PRODUCERS[language], str(PHOTOS / "4.webp")]
    photo_id = uuid.UUID(run(file_env, command, TRACEPARENT=carrier["traceparent"]).strip())
    (entry,) = file_env.redis.xrange(file_env.stream)
    assert entry[1] == {"photo_id": str(photo_id), "traceparent": carrier["traceparent"]}
    [row] = file_env.query("SELECT traceparent FROM photos WHERE id = $1", photo_id)
    assert row["traceparent"] == carrier["traceparent"]
    file_env.cli("run", "--drain", **otel(receiver))
    [process] = process_spans(receiver, trace_id)
    assert process.parent_id == producer_id
    assert process.attributes["darkroom.photo_id"] == str(photo_id)


def test_the_node_producer_under_opentelemetry_exports_its_span_and_darkroom_joins_it(
    file_env: Env, receiver: Receiver
) -> None:
    """`node --import ./tracing.js produce.js` with an OTLP endpoint: the producer's own
    `darkroom.produce` span (PRODUCER, its OTEL_SERVICE_NAME) reaches the collector over
    OTLP/protobuf, its context is on the entry and the row, and the traced worker's span of
    the photo is its child, in its trace."""
    node = EXAMPLES / "node"
    command = [str(NODE), "--import", str(node / "tracing.js"), str(node / "produce.js"),
               str(PHOTOS / "4.webp")]  # fmt: skip
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "producer"}
    photo_id = uuid.UUID(run(file_env, command, **traced).strip())
    [produce] = receiver.named("darkroom.produce")
    assert (produce.kind, produce.service) == (4, "producer")  # SPAN_KIND_PRODUCER
    traceparent = f"00-{produce.trace_id}-{produce.span_id}-01"
    (entry,) = file_env.redis.xrange(file_env.stream)
    assert entry[1] == {"photo_id": str(photo_id), "traceparent": traceparent}
    [row] = file_env.query("SELECT traceparent FROM photos WHERE id = $1", photo_id)
    assert row["traceparent"] == traceparent
    file_env.cli("run", "--drain", **otel(receiver))
    [process] = process_spans(receiver, produce.trace_id)
    assert process.parent_id == produce.span_id


def test_the_postgresql_only_producer_leaves_the_row_to_the_intake(file_env: Env) -> None:
    """`--pg-only`: the row, not yet enqueued (enqueued_at NULL), and no entry."""
    out = run(file_env, [*PRODUCERS["python"], "--pg-only", str(PHOTOS / "4.webp")])
    rows = file_env.query("SELECT enqueued_at FROM photos WHERE id = $1", uuid.UUID(out.strip()))
    assert rows == [{"enqueued_at": None}]
    assert file_env.redis.xlen(file_env.stream) == 0


@pytest.mark.parametrize("language", ["python", "node"])
def test_the_consumer_handles_each_event_once(file_env: Env, language: str) -> None:
    """Three deliveries of two events: two handled; a restart handles nothing again."""
    events = events_stream(file_env)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    for event_id in (first, second, first):  # a duplicate, as a relay's retry would send
        file_env.redis.xadd(events, {"event": cloud_event(event_id, str(uuid.uuid4()))})
    try:
        handled = run(file_env, CONSUMERS[language], DARKROOM_EVENTS_STREAM=events)
        assert [line.split()[2] for line in handled.splitlines()] == [first, second]
        assert run(file_env, CONSUMERS[language], DARKROOM_EVENTS_STREAM=events) == ""
        assert file_env.redis.xpending(events, "example-gallery")["pending"] == 0
    finally:
        file_env.redis.delete(events)
