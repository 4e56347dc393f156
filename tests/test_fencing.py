"""Fencing tokens and re-render generations, against the real servers: a holder that froze
past its lease changes nothing its successor owns, a failed re-render leaves nothing counted
in flight, a request made during a render is rendered again once, and a duplicate entry of
a photo a live worker holds is settled at once."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import pytest
import structlog

from darkroom.errors import CorruptImageError, RenderTimeoutError
from darkroom.queue.messages import Entry, Task, task_fields
from darkroom.queue.streams import Streams
from darkroom.store import db, failures, intake, leases, publishing, views
from darkroom.store import lanes as store_lanes
from darkroom.worker import Worker
from tests import test_worker_inprocess
from tests.conftest import PHOTOS
from tests.faults import FakeClock

worker = test_worker_inprocess.worker  # the in-process worker fixture, shared
FACTS = {"width": 4, "height": 3, "format": "jpeg", "bytes": 10}
LONG = leases.Lease("A", 60_000, 5)


def second(a: Worker, consumer: str = "w2") -> Worker:
    streams = Streams(
        a.streams.client, a.streams.stream, "darkroom", consumer, a.streams.dead_stream
    )
    return Worker(a.settings, a.pool, streams, a.storage, clock=FakeClock())


async def one_photo(w: Worker) -> tuple[uuid.UUID, Entry]:
    photo_id = uuid.uuid4()
    key = f"originals/{photo_id}/4.webp"
    await w.storage.put(key, (PHOTOS / "4.webp").read_bytes(), "image/webp")
    await db.insert_photo(w.pool, photo_id, key)
    await w.streams.enqueue(task_fields(photo_id))
    [entry] = await w.streams.read_new(1, 100)
    return photo_id, entry


async def until(check: Any) -> None:
    for _ in range(2000):
        if await check():
            return
        await anyio.sleep(0.01)
    raise AssertionError("timed out")


async def expire_and_reclaim(a: Worker, entry: Entry) -> None:
    """A froze past its lease: it ran out, and w2's XAUTOCLAIM took the entry."""
    await a.pool.execute("UPDATE photo_jobs SET lease_until = now() - interval '1 s'")
    await a.streams.client.xclaim(a.streams.stream, "darkroom", "w2", 0, [entry.id])


async def pending_to(w: Worker, entry_id: str) -> list[str]:
    rows = await w.streams.client.xpending_range(
        w.streams.stream, "darkroom", entry_id, entry_id, 1
    )
    return [r["consumer"] for r in rows]


async def test_a_holder_that_froze_past_its_lease_cannot_publish_over_its_successor(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A freezes before its publish; its lease runs out, B reclaims the entry (token 2) and
    renders. A's late publish is refused: the row, B's job and B's entry are untouched (A
    neither acks nor deletes it), A's history row is not the published one; B publishes."""
    a, b = worker, second(worker)
    photo_id, entry = await one_photo(a)
    real, statuses = publishing.publish, {}
    b_claimed, a_refused = anyio.Event(), anyio.Event()

    async def frozen_a(pool: Any, pid: Any, facts: Any, rend: Any, lease: Any, *more: Any) -> Any:
        if lease[0] == 1:  # A, waking after its freeze: B holds the entry by now
            await b_claimed.wait()
        if lease[0] == 2:
            await a_refused.wait()
        published = await real(pool, pid, facts, rend, lease, *more)
        statuses[lease[0]] = published.status
        if lease[0] == 1:
            a_refused.set()
        return published

    async def b_takes_over() -> None:
        await until(lambda: a.pool.fetchval("SELECT lease_token FROM photo_jobs"))
        await expire_and_reclaim(a, entry)
        assert b.in_flight.admit(entry.id)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.jobs.handle, entry, 2)
            await until(lambda: a.pool.fetchval("SELECT lease_token = 2 FROM photo_jobs"))
            b_claimed.set()

    monkeypatch.setattr(publishing, "publish", frozen_a)
    assert a.in_flight.admit(entry.id)
    async with a.renderer, b.renderer, anyio.create_task_group() as tg:
        tg.start_soon(b_takes_over)
        await a.jobs.handle(entry, 1)
        assert await pending_to(a, entry.id) == ["w2"], "A left B's entry alone"
    assert statuses == {1: "lost", 2: "published"}
    job = await a.pool.fetchrow("SELECT state, consumer, lease_token FROM photo_jobs")
    assert tuple(job) == ("done", "w2", 2)
    outcomes = await a.pool.fetch("SELECT consumer, outcome FROM photo_attempts ORDER BY id")
    assert [tuple(r) for r in outcomes] == [("w1", "lease_lost"), ("w2", "published")]
    renditions = json.loads(await a.pool.fetchval("SELECT renditions FROM photos"))
    for r in renditions:
        assert len(await a.storage.get(r["key"], 1 << 30)) == r["bytes"]
    events = await a.pool.fetch("SELECT type FROM photo_events WHERE photo_id = $1", photo_id)
    assert [e["type"] for e in events] == ["darkroom.photo.published"]
    assert await a.streams.client.xlen(a.streams.stream) == 0, "B acked its entry"


async def test_a_stale_retry_leaves_the_new_holders_job_and_entry_alone(worker: Worker) -> None:
    """A's render fails (retryable) after B reclaimed the entry: the retry is refused by the
    token, B's job stays active, and A's backoff does not take the entry back from B."""
    a = worker
    photo_id, entry = await one_photo(a)
    assert a.in_flight.admit(entry.id)
    a_claim = await a.jobs._claim(entry, Task(photo_id))
    await expire_and_reclaim(a, entry)
    b_claim = await leases.claim(a.pool, photo_id, entry.id, "w2", leases.Lease("B", 60_000, 5))
    assert (a_claim.token, b_claim.token) == (1, 2)
    await a.jobs._fail(entry, 1, RenderTimeoutError("A's render timed out"), structlog.get_logger())
    job = await a.pool.fetchrow("SELECT state, lease_token, error_code FROM photo_jobs")
    assert tuple(job) == ("active", 2, None)
    assert await pending_to(a, entry.id) == ["w2"]


async def test_a_stale_holders_final_failure_is_refused(worker: Worker) -> None:
    """A's render fails for good after B reclaimed the entry: nothing is recorded (the
    photo is not failed, no dead letter), the entry stays B's."""
    a = worker
    photo_id, entry = await one_photo(a)
    assert a.in_flight.admit(entry.id)
    await a.jobs._claim(entry, Task(photo_id))
    await expire_and_reclaim(a, entry)
    await leases.claim(a.pool, photo_id, entry.id, "w2", leases.Lease("B", 60_000, 5))
    await a.jobs._fail(entry, 9, CorruptImageError("late"), structlog.get_logger())
    assert await db.photo_state(a.pool, photo_id) == "processing"
    assert await a.streams.client.xlen(a.streams.dead_stream) == 0
    assert await pending_to(a, entry.id) == ["w2"]


async def processed(pool: db.Pool, lane: str = "interactive", tenant: str = "") -> uuid.UUID:
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, "originals/x.jpg")
    await pool.execute(
        "UPDATE photos SET lane = $2, tenant = $3 WHERE id = $1", photo_id, lane, tenant
    )
    claim = await leases.claim(pool, photo_id, "1-0", "w1", LONG)
    done = await publishing.publish(pool, photo_id, FACTS, "[]", (claim.token, "1-0"))
    assert done.status == "published"
    return photo_id


async def test_a_failed_bulk_rerender_leaves_nothing_in_flight(database_url: str) -> None:
    """DARKROOM_TENANT_MAX_IN_FLIGHT counts fed, unfinished work: a bulk re-render that
    failed for good no longer counts, so its tenant is fed again; a late duplicate entry of
    it claims nothing."""
    pool = await db.connect(database_url, 2)
    try:
        photo_id = await processed(pool, "bulk", "acme")
        assert await publishing.request_rerender(pool, [photo_id], None) == [photo_id]
        assert await store_lanes.to_feeder(pool, photo_id)
        await pool.execute("UPDATE photos SET enqueued_at = now()")  # the feeder's XADD
        async with pool.acquire() as conn:
            assert await intake.in_flight(conn) == {"acme": 1}
        claim = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
        failed = await failures.record_rerender_failure(pool, photo_id, claim.token, "timeout", "x")
        assert failed == "answered"
        async with pool.acquire() as conn:
            assert await intake.in_flight(conn) == {}
        late = await leases.claim(pool, photo_id, "3-0", "w2", leases.Lease("B", 60_000, 5))
        assert late.outcome == "already"
    finally:
        await pool.close()


async def test_a_request_made_during_a_render_is_rendered_again_once(database_url: str) -> None:
    """Requests are generations: the publish of a render claimed at generation 1 answers
    only it; the request made meanwhile (generation 2) stays and sends the photo through
    again (enqueued_at cleared); the next render answers it, and nothing more is asked."""
    pool = await db.connect(database_url, 2)
    try:
        photo_id = await processed(pool)
        await publishing.request_rerender(pool, [photo_id], None)
        first = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
        await publishing.request_rerender(pool, [photo_id], None)  # during the render
        done = await publishing.publish(pool, photo_id, FACTS, "[]", (first.token, "2-0"))
        assert (done.status, done.again) == ("published", True)
        row = await pool.fetchrow("SELECT rerender_requested_at, enqueued_at FROM photos")
        assert row["rerender_requested_at"] is not None and row["enqueued_at"] is None
        second_claim = await leases.claim(pool, photo_id, "3-0", "w1", LONG)
        assert second_claim.outcome == "claimed"
        done = await publishing.publish(pool, photo_id, FACTS, "[]", (second_claim.token, "3-0"))
        assert (done.status, done.again) == ("published", False)
        assert await pool.fetchval("SELECT rerender_requested_at FROM photos") is None
        again = await leases.claim(pool, photo_id, "4-0", "w1", LONG)
        assert again.outcome == "already"
        events = await pool.fetch("SELECT type FROM photo_events ORDER BY id")
        assert [e["type"].rsplit(".", 1)[1] for e in events] == [
            "published", "rerendered", "rerendered"
        ]  # fmt: skip
    finally:
        await pool.close()


async def test_an_interactive_request_made_during_a_render_is_enqueued_by_its_worker(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker whose publish leaves a newer request XADDs the photo again at once."""
    photo_id, entry = await one_photo(worker)
    real = publishing.publish

    async def request_meanwhile(*args: Any) -> Any:
        await publishing.request_rerender(worker.pool, [photo_id], None)
        return await real(*args)

    async with worker.renderer:
        assert worker.in_flight.admit(entry.id)
        await worker.jobs.handle(entry, 1)  # the first render
        await publishing.request_rerender(worker.pool, [photo_id], None)
        await worker.streams.enqueue(task_fields(photo_id))
        [rerender] = await worker.streams.read_new(1, 100)
        monkeypatch.setattr(publishing, "publish", request_meanwhile)
        assert worker.in_flight.admit(rerender.id)
        await worker.jobs.handle(rerender, 1)
    [follow_up] = await worker.streams.read_new(1, 100)
    assert follow_up.fields["photo_id"] == str(photo_id)
    row = await worker.pool.fetchrow("SELECT rerender_requested_at, enqueued_at FROM photos")
    assert row["rerender_requested_at"] is not None and row["enqueued_at"] is not None


async def test_a_photo_moved_to_bulk_during_its_render_goes_again_through_the_feeder(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bulk re-render of an interactive photo while its interactive re-render runs moves
    it to the bulk lane: the publish sends it again through the feeder (its new lane), not
    the interactive stream its entry came from, so the feeder counts nothing in flight for
    it before it feeds it."""
    photo_id, entry = await one_photo(worker)
    real = publishing.publish

    async def moved_meanwhile(*args: Any) -> Any:
        await publishing.request_rerender(worker.pool, [photo_id], None)
        assert await store_lanes.to_feeder(worker.pool, photo_id)  # a bulk rerender's
        return await real(*args)

    async with worker.renderer:
        assert worker.in_flight.admit(entry.id)
        await worker.jobs.handle(entry, 1)  # the first render
        await publishing.request_rerender(worker.pool, [photo_id], None)
        await worker.streams.enqueue(task_fields(photo_id))
        [rerender] = await worker.streams.read_new(1, 100)
        monkeypatch.setattr(publishing, "publish", moved_meanwhile)
        assert worker.in_flight.admit(rerender.id)
        await worker.jobs.handle(rerender, 1)
    assert await worker.streams.read_new(1, 100) == []
    row = await worker.pool.fetchrow("SELECT lane, enqueued_at FROM photos")
    assert (row["lane"], row["enqueued_at"]) == ("bulk", None)
    async with worker.pool.acquire() as conn:
        assert await intake.in_flight(conn) == {}
    assert await intake.has_unfed(worker.pool, False)  # the feeder's to feed


async def test_a_duplicate_entry_of_a_photo_a_live_worker_holds_is_settled_at_once(
    worker: Worker,
) -> None:
    """A duplicate entry (a producer's and the intake's XADD) meets the live holder's job:
    it is acked at once, not left pending for DARKROOM_CLAIM_IDLE_MS; the holder's own
    entry stays pending to it."""
    a, b = worker, second(worker)
    photo_id, entry = await one_photo(a)
    await leases.claim(a.pool, photo_id, entry.id, "w1", a.jobs.lease)
    await a.streams.enqueue(task_fields(photo_id))
    [duplicate] = await b.streams.read_new(1, 100)
    assert b.in_flight.admit(duplicate.id)
    await b.jobs.handle(duplicate, 1)
    assert await pending_to(a, duplicate.id) == []
    assert await pending_to(a, entry.id) == ["w1"]


async def test_status_counts_what_live_leases_hold(database_url: str) -> None:
    """`status`'s "rendering now" comes from the leases themselves: a job whose lease ran
    out (its worker died) is not counted, whatever flag its row still carries."""
    pool = await db.connect(database_url, 2)
    try:
        photo_id = uuid.uuid4()
        await db.insert_photo(pool, photo_id, "originals/x.jpg")
        await pool.execute("UPDATE photos SET lane = 'bulk', tenant = 'acme'")
        await leases.claim(pool, photo_id, "1-0", "w1", LONG)
        assert await views.leased(pool) == [{"lane": "bulk", "tenant": "acme", "n": 1}]
        await pool.execute("UPDATE photo_jobs SET lease_until = now() - interval '1 s'")
        assert await views.leased(pool) == []
    finally:
        await pool.close()


async def test_a_stale_publish_leaves_an_entry_its_successor_set_back_for_a_retry(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A froze before its publish; B reclaimed the entry, claimed it and recorded a retry
    (the job pending again through this entry, its backoff running). A's late publish is
    refused and A does not ack the entry: B's retry still comes."""
    a = worker
    photo_id, entry = await one_photo(a)
    real = publishing.publish

    async def frozen(pool: Any, pid: Any, facts: Any, rend: Any, lease: Any, *more: Any) -> Any:
        await expire_and_reclaim(a, entry)
        b = await leases.claim(a.pool, photo_id, entry.id, "w2", leases.Lease("B", 60_000, 5))
        assert await failures.record_retry(a.pool, photo_id, b.token, "render_timeout", "x", 60_000)
        return await real(pool, pid, facts, rend, lease, *more)

    monkeypatch.setattr(publishing, "publish", frozen)
    assert a.in_flight.admit(entry.id)
    async with a.renderer:
        await a.jobs.handle(entry, 1)
    assert await pending_to(a, entry.id) == ["w2"], "A left B's entry alone"
    assert tuple(await a.pool.fetchrow("SELECT state, lease_token FROM photo_jobs")) == (
        "pending", 2)  # fmt: skip


async def test_a_stale_rerender_failure_leaves_an_entry_its_successor_set_back(
    worker: Worker,
) -> None:
    """The same for a re-render: A's late final failure is refused, the re-render is B's
    (pending for its retry through this entry), and A does not ack the entry."""
    a = worker
    photo_id, entry = await one_photo(a)
    async with a.renderer:
        assert a.in_flight.admit(entry.id)
        await a.jobs.handle(entry, 1)
    await publishing.request_rerender(a.pool, [photo_id], None)
    await a.streams.enqueue(task_fields(photo_id))
    [rerender] = await a.streams.read_new(1, 100)
    assert a.in_flight.admit(rerender.id)
    assert (await a.jobs._claim(rerender, Task(photo_id))).outcome == "claimed"
    await expire_and_reclaim(a, rerender)
    b = await leases.claim(a.pool, photo_id, rerender.id, "w2", leases.Lease("B", 60_000, 5))
    assert await failures.record_retry(a.pool, photo_id, b.token, "render_timeout", "x", 60_000)
    await a.jobs._fail(rerender, 1, CorruptImageError("late"), structlog.get_logger())
    assert await pending_to(a, rerender.id) == ["w2"]
    assert await a.pool.fetchval("SELECT rerender_requested_at IS NOT NULL FROM photos")


async def test_an_entry_whose_run_is_done_starts_no_new_work(database_url: str) -> None:
    """A worker reclaims an entry whose holder then publishes and acks it (the entry is gone
    from the stream); a re-render is requested meanwhile. The reclaimer's claim of that
    entry answers `already`: the re-render has an entry of its own, and a lease taken under
    a deleted entry would be found by no reclaim were its worker to die."""
    pool = await db.connect(database_url, 2)
    try:
        photo_id = await processed(pool, "bulk", "t")
        await pool.execute(
            "UPDATE photos SET rerender_requested_at = now(),"
            " rerender_generation = rerender_generation + 1 WHERE id = $1",
            photo_id,
        )
        stale = await leases.claim(pool, photo_id, "1-0", "w2", leases.Lease("B", 60_000, 5))
        assert stale.outcome == "already"
        fresh = await leases.claim(pool, photo_id, "2-0", "w3", leases.Lease("C", 60_000, 5))
        assert fresh.outcome == "claimed"
    finally:
        await pool.close()
