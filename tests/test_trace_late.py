"""Spans the exporter never confirmed, written late from the attempt history: a delivery that
ended but whose worker was SIGKILLed before its batch left still has its `darkroom.process`
span in the photo's trace (written by another traced worker, with the id its claim kept);
an exported one is confirmed on its row and never written twice; which rows a late writer
takes, against the real PostgreSQL; the span's shape, in-process."""

from __future__ import annotations

import signal
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from darkroom import latespans, spanwriter, tracing
from darkroom.store import db, leases, spans
from tests.conftest import Env
from tests.otlp import Receiver, producer_span
from tests.test_recovery import wait_for
from tests.test_tracing import add_photo, otel, receiver, xadd

__all__ = ["receiver"]  # the fixture, used by name
PROCESSED = "SELECT 1 FROM photos WHERE id = $1 AND processing_state = 'processed'"
SENT = "SELECT 1 FROM photo_attempts WHERE photo_id = $1 AND span_sent"


def test_a_delivery_whose_worker_died_before_its_export_is_written_late(
    file_env: Env, receiver: Receiver
) -> None:
    """The first worker publishes the photo and is SIGKILLed with the delivery's spans still
    in its batch (a 60 s batch delay): none of its spans left. Another traced worker, past
    the grace, writes the delivery's `darkroom.process` span from its attempt row: the row's
    span id, the producer's child in its trace, from its claim to its end, `published`,
    marked late; the row is then settled, and no second copy follows."""
    trace_id, producer_id, carrier = producer_span()
    photo_id = add_photo(file_env)
    entry_id = xadd(file_env, photo_id, carrier)
    held = file_env.start("run", **otel(receiver, OTEL_BSP_SCHEDULE_DELAY="60000"))
    wait_for(file_env, PROCESSED, photo_id, proc=held)
    held.kill()
    held.communicate()
    assert receiver.of_trace(trace_id) == []  # the kill took every span of the delivery
    [row] = file_env.query("SELECT * FROM photo_attempts WHERE photo_id = $1", photo_id)
    assert row["span_id"] is not None and not row["span_sent"]
    late = file_env.start("run", **otel(receiver, OTEL_EXPORTER_OTLP_TIMEOUT="0.5"))
    wait_for(file_env, SENT, photo_id, proc=late)
    late.send_signal(signal.SIGTERM)
    assert late.wait(60) == 0
    span, publish = sorted(receiver.of_trace(trace_id), key=lambda s: s.name)
    assert (span.span_id, span.parent_id, span.name) == (row["span_id"], producer_id,
                                                         "darkroom.process")  # fmt: skip
    # the trace reaches the final publish: its span timed by the publishing statement
    assert (publish.name, publish.parent_id) == ("darkroom.publish", span.span_id)
    assert publish.start_ns == int(row["ended_at"].timestamp() * 1e9)
    assert publish.end_ns - publish.start_ns == pytest.approx(row["publish_ms"] * 1e6, abs=1e3)
    assert publish.end_ns == span.end_ns  # the child inside its parent
    assert span.attributes["darkroom.outcome"] == "published" and span.attributes["darkroom.late"]
    assert span.attributes["messaging.message.id"] == entry_id and span.status != 2
    assert span.start_ns == int(row["started_at"].timestamp() * 1e9)
    assert span.end_ns >= int(row["ended_at"].timestamp() * 1e9)


def test_an_exported_delivery_is_confirmed_and_never_written_twice(
    file_env: Env, receiver: Receiver
) -> None:
    """A traced worker's delivery, exported as usual: its row is settled from the exporter's
    report, and past the grace no late copy of its span appears."""
    trace_id, _, carrier = producer_span()
    photo_id = add_photo(file_env)
    xadd(file_env, photo_id, carrier)
    settings = otel(receiver, OTEL_EXPORTER_OTLP_TIMEOUT="0.5")
    worker = file_env.start("run", **settings)
    wait_for(file_env, SENT, photo_id, proc=worker)
    second = file_env.start("run", **settings)  # its late writer's first pass is past the grace
    wait_for(file_env, "SELECT 1 WHERE clock_timestamp() > $1::timestamptz", datetime.now(UTC)
             + timedelta(seconds=latespans.grace_s(settings) + 3), proc=second)  # fmt: skip
    for proc in (worker, second):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    processes = [s for s in receiver.of_trace(trace_id) if s.name == "darkroom.process"]
    assert len(processes) == 1 and "darkroom.late" not in processes[0].attributes


def test_a_stopping_worker_marks_the_spans_of_its_last_batch(
    file_env: Env, receiver: Receiver
) -> None:
    """A SIGTERM with a delivery's spans still in the batch (a 60 s delay): the stop exports
    them and marks the row before it exits, so no late writer copies them later."""
    trace_id, _, carrier = producer_span()
    photo_id = add_photo(file_env)
    xadd(file_env, photo_id, carrier)
    worker = file_env.start("run", **otel(receiver, OTEL_BSP_SCHEDULE_DELAY="60000"))
    wait_for(file_env, PROCESSED, photo_id, proc=worker)
    assert receiver.of_trace(trace_id) == []
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0 and "Exception while exporting" not in stderr
    assert file_env.query(SENT, photo_id), stderr[-3000:]
    assert len([s for s in receiver.of_trace(trace_id) if s.name == "darkroom.process"]) == 1


def test_the_grace_comes_from_the_standard_variables() -> None:
    """Three times the batch delay (milliseconds) and the export timeout (seconds, as this
    SDK reads it), at least 10 s."""
    assert latespans.grace_s({}) == 24.0
    assert latespans.grace_s({"OTEL_BSP_SCHEDULE_DELAY": "10000"}) == 39.0
    assert latespans.grace_s({"OTEL_BSP_SCHEDULE_DELAY": "100"}) == latespans.MIN_GRACE_S
    assert latespans.grace_s({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "20"}) == 75.0
    assert latespans.grace_s({"OTEL_BSP_SCHEDULE_DELAY": "soon"}) == 24.0


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    pool = await db.connect(database_url, 3)
    yield pool
    await pool.close()


ROW_SQL = """
INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane, started_at, ended_at, outcome,
    span_id, span_sent)
VALUES ($1, '1-0', $2, 'interactive', now() - $3 * interval '1 s',
        now() - $4 * interval '1 s', $5, $6, $7)
"""


async def row(
    pool: db.Pool, photo_id: uuid.UUID, consumer: str, started_ago: float,
    ended_ago: float | None, span_id: str | None, sent: bool = False, outcome: str = "",
) -> None:  # fmt: skip
    outcome = outcome or ("running" if ended_ago is None else "published")
    await pool.execute(ROW_SQL, photo_id, consumer, started_ago, ended_ago, outcome, span_id, sent)


async def taken(pool: db.Pool, grace_s: float) -> set[str]:
    async with spans.unsent(pool, grace_s, 100) as batch:
        return {r.span_id for r in batch.rows}


async def photo(pool: db.Pool, holder: str) -> uuid.UUID:
    """A photo whose job `holder` claimed through entry 1-0 (a live 60 s lease)."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    await leases.claim(pool, photo_id, "1-0", holder, leases.Lease("B", 60_000, 5))
    return photo_id


async def test_a_late_writer_takes_only_rows_nobody_can_still_export(pool: db.Pool) -> None:
    """Past the grace and unconfirmed: an ended delivery; a `running` one whose job another
    claim took. Not: one within the grace, a confirmed one, one without a span id, one older
    than the window, a `running` one whose job still names it under a live lease (its
    worker lives, whatever claims came after), nor a killed one whose only later rows are
    deliveries that found the job busy (no reclaim has written its span yet)."""
    first = await photo(pool, "w2")
    await row(pool, first, "w0", 100, 90, "a" * 16)  # ended long ago: taken
    await row(pool, first, "w0", 100, 1, "b" * 16)  # ended within the grace
    await row(pool, first, "w0", 100, 90, "c" * 16, sent=True)  # confirmed
    await row(pool, first, "w0", 100, 90, None)  # untraced
    await row(pool, first, "w0", 7200, 7100, "d" * 16)  # past the window
    await row(pool, first, "w1", 80, None, "e" * 16)  # killed, reclaimed 50 s ago: taken
    await row(pool, first, "w2", 50, None, "f" * 16)  # the job's live holder
    await pool.execute("UPDATE photo_jobs SET stream_entry = '1-0' WHERE photo_id = $1", first)
    await row(pool, first, "w3", 40, 39, None, outcome="retrying")  # a claim after it
    second = await photo(pool, "w6")
    await row(pool, second, "w5", 100, None, "0" * 15 + "1")  # killed
    await row(pool, second, "w7", 90, 90, None, outcome="busy")  # found the job busy
    await row(pool, second, "w6", 1, None, "0" * 15 + "2")  # the reclaim, just now
    assert await taken(pool, 30) == {"a" * 16, "e" * 16}


async def test_two_late_writers_never_take_the_same_row(pool: db.Pool) -> None:
    """A row held by one writer's batch is skipped by another's; settled, it is taken by none."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    await row(pool, photo_id, "w0", 100, 90, "a" * 16)
    async with spans.unsent(pool, 30, 100) as first:
        assert [r.span_id for r in first.rows] == ["a" * 16]
        assert await taken(pool, 30) == set()
        await first.settle(first.rows)
    assert await taken(pool, 30) == set()


def test_a_late_span_carries_the_rows_story() -> None:
    """In-process, to memory: an ended row's span ends at its end with its error; a killed
    row's at the next claim, `worker_died`; a photo without a context gets none."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(id_generator=tracing._preset_ids())
    processor = SimpleSpanProcessor(memory)
    provider.add_span_processor(processor)
    trace_id, parent_id, carrier = producer_span()
    t0 = datetime.now(UTC) - timedelta(seconds=60)
    failed = spans.Unsent(1, uuid.uuid4(), "5-0", "bulk", "00f067aa0ba902b7", t0,
                          t0 + timedelta(seconds=2), None, "retrying", "storage_unavailable",
                          "S3 down", carrier["traceparent"], "acme")  # fmt: skip
    killed = spans.Unsent(2, uuid.uuid4(), "6-0", "interactive", "00f067aa0ba902b8", t0, None,
                          t0 + timedelta(seconds=9), "running", None, None,
                          carrier["traceparent"], "")  # fmt: skip
    untraced = spans.Unsent(3, uuid.uuid4(), "7-0", "interactive", "00f067aa0ba902b9", t0,
                            t0, None, "published", None, None, None, "")  # fmt: skip
    tracing.use(provider, processor)
    try:
        written = [spanwriter.written_late(u, "s", "g") for u in (failed, killed, untraced)]
    finally:
        tracing.use(None, None)
    assert written == [True, True, False]
    first, second = memory.get_finished_spans()
    assert (first.context.trace_id, first.parent.span_id) == (int(trace_id, 16), int(parent_id, 16))
    assert first.context.span_id == 0x00F067AA0BA902B7
    assert first.end_time - first.start_time == 2_000_000_000
    assert first.attributes["error.type"] == "storage_unavailable"
    assert first.attributes["darkroom.tenant"] == "acme" and first.attributes["darkroom.late"]
    assert second.attributes["darkroom.outcome"] == "worker_died"
    assert second.end_time - second.start_time == 9_000_000_000
