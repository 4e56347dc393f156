"""The attempt history: every delivery that reaches a worker leaves a row with its
stage timings and outcome; a worker's death shows in the timeline; `darkroom photos show`
and `darkroom attempts` read it; retention deletes expired rows in batches. Against the
real servers."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from darkroom import recorder
from darkroom.queue.messages import Entry
from darkroom.store import db, failures, history, leases, publishing
from tests.conftest import PHOTOS, Env

IPHONE = PHOTOS / "iphone_hdr_NO.jpg"


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    pool = await db.connect(database_url, 2)
    yield pool
    await pool.close()


def drained(file_env: Env, tmp_name: str = "broken.jpg") -> tuple[uuid.UUID, uuid.UUID]:
    """The iPhone photo and a truncated JPEG, plus a malformed entry, through `run --drain`."""
    broken = file_env.tmp / tmp_name
    broken.write_bytes(IPHONE.read_bytes()[:300])
    good, bad = file_env.ingest([IPHONE, broken])
    file_env.redis.xadd(file_env.stream, {"photo_id": "not-a-uuid"})
    file_env.cli("run", "--drain", DARKROOM_MAX_ATTEMPTS="1")
    return good, bad


def test_every_delivery_leaves_a_finished_row(file_env: Env) -> None:
    """A published photo: one row with its four stage times and peak RSS; a corrupt one:
    `failed` with its code; a malformed entry: a row without a photo, `bad_message`."""
    good, bad = drained(file_env)
    rows = file_env.query("SELECT * FROM photo_attempts ORDER BY id")
    by_photo = {r["photo_id"]: r for r in rows}
    published = by_photo[good]
    assert published["outcome"] == "published" and published["lane"] == "interactive"
    assert all(published[f"{s}_ms"] > 0 for s in history.STAGES)
    assert published["peak_rss_mb"] > 0 and published["ended_at"] >= published["started_at"]
    assert (by_photo[bad]["outcome"], by_photo[bad]["error_code"]) == ("failed", "corrupt_image")
    assert by_photo[None]["error_code"] == "bad_message"
    assert len(rows) == 3


def test_photos_show_carries_the_facts_and_the_timeline(file_env: Env) -> None:
    """`photos show ID --json`: camera, capture time, placeholder and one published attempt;
    the text form names the camera and the outcome."""
    good, _ = drained(file_env)
    report = json.loads(file_env.cli("photos", "show", str(good), "--json").stdout)
    facts = report["facts"]
    assert (facts["camera_make"], facts["camera_model"]) == ("Apple", "iPhone 6")
    assert facts["taken_at_local"].startswith("2015-04-10T20:12:23")
    assert facts["placeholder"].startswith("data:image/png;base64,")
    assert [a["outcome"] for a in report["attempts"]] == ["published"]
    text = file_env.cli("photos", "show", str(good)).stdout
    assert "Apple iPhone 6" in text and "2015-04-10 20:12:23" in text and "published" in text


def test_attempts_searches_by_code_and_consumer(file_env: Env) -> None:
    """`attempts --code` finds only that code's deliveries; an unknown consumer finds none."""
    _, bad = drained(file_env)
    found = json.loads(file_env.cli("attempts", "--code", "corrupt_image", "--json").stdout)
    assert [r["photo_id"] for r in found] == [str(bad)]
    since = json.loads(file_env.cli("attempts", "--since", "2000-01-01", "--json").stdout)
    assert len(since) == 3
    none = json.loads(file_env.cli("attempts", "--consumer", "nobody", "--json").stdout)
    assert none == []


async def claimed(pool: db.Pool, ms: int) -> tuple[uuid.UUID, int]:
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    await leases.claim(pool, photo_id, "1-0", "w1", leases.Lease("A", ms, 5))
    return photo_id, await history.start(pool, photo_id, "1-0", "w1", "interactive")


async def test_a_dead_workers_delivery_shows_as_worker_died(pool: db.Pool) -> None:
    """A `running` row is `running` while its job's lease lives and `worker_died` after."""
    photo_id, _ = await claimed(pool, 60_000)
    assert [a["outcome"] for a in await history.timeline(pool, photo_id)] == ["running"]
    await pool.execute("UPDATE photo_jobs SET lease_until = now() - interval '1 s'")
    assert [a["outcome"] for a in await history.timeline(pool, photo_id)] == ["worker_died"]


async def test_a_reclaim_marks_the_first_delivery_dead(pool: db.Pool) -> None:
    """Another consumer's claim of the same entry after the lease ran out: the first row is
    `worker_died`, the new one `running`."""
    photo_id, _ = await claimed(pool, 1)
    await leases.claim(pool, photo_id, "1-0", "w2", leases.Lease("B", 60_000, 5))
    await history.start(pool, photo_id, "1-0", "w2", "interactive")
    shown = [(a["consumer"], a["outcome"]) for a in await history.timeline(pool, photo_id)]
    assert shown == [("w1", "worker_died"), ("w2", "running")]


async def test_retention_deletes_only_expired_rows_in_batches(
    pool: db.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows older than the kept days go, in several batches; younger ones stay."""
    await pool.execute(
        "INSERT INTO photo_attempts (entry_id, consumer, started_at, outcome)"
        " SELECT i || '-0', 'w', now() - interval '40 days', 'published'"
        " FROM generate_series(1, 25) i"
    )
    await claimed(pool, 60_000)
    monkeypatch.setattr(recorder, "PRUNE_BATCH", 10)
    monkeypatch.setattr(recorder, "PRUNE_PAUSE_S", 0)
    assert await recorder.prune_expired(pool, 30) == 25
    assert await pool.fetchval("SELECT count(*) FROM photo_attempts") == 1
    assert await recorder.prune_expired(pool, 30) == 0


async def test_search_filters_by_since(pool: db.Pool) -> None:
    """`since` keeps the deliveries started at or after it, newest first."""
    await claimed(pool, 60_000)
    later = datetime.now(UTC).replace(year=datetime.now(UTC).year + 1)
    assert await history.search(pool, None, later, None, 10) == []
    assert len(await history.search(pool, None, None, None, 10)) == 1


async def test_the_claim_writes_the_running_row_once_per_delivery(pool: db.Pool) -> None:
    """The claim inserts its delivery's `running` row in its own statement. A second claim
    by the same process for the same entry (its first reply was lost) gets that row back,
    no second one; a claim that finds the job held, or with the history off, writes none."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    lease = leases.Lease("A", 60_000, 5)
    first = await leases.claim(pool, photo_id, "1-0", "w1", lease, "bulk")
    again = await leases.claim(pool, photo_id, "1-0", "w1", lease, "bulk")
    assert first.outcome == again.outcome == "claimed"
    assert first.history_row is not None and again.history_row == first.history_row
    busy = await leases.claim(pool, photo_id, "2-0", "w2", leases.Lease("B", 60_000, 5), "bulk")
    assert busy.outcome == "busy" and busy.history_row is None
    rows = await history.timeline(pool, photo_id)
    assert [(a["consumer"], a["lane"], a["outcome"]) for a in rows] == [("w1", "bulk", "running")]
    other = uuid.uuid4()
    await db.insert_photo(pool, other, f"originals/{other}/x.jpg")
    quiet = await leases.claim(pool, other, "3-0", "w1", lease, None)
    assert quiet.outcome == "claimed" and quiet.history_row is None
    assert await history.timeline(pool, other) == []


async def test_the_publishing_commit_finishes_the_published_deliverys_row(pool: db.Pool) -> None:
    """A publish given the delivery's row finishes it `published` in its own statement,
    with the stage times and peak RSS handed to it and its own time as the publish time; a
    publish that loses (the photo was published meanwhile) leaves its row to the worker."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    lease = leases.Lease("A", 60_000, 5)
    claim = await leases.claim(pool, photo_id, "1-0", "w1", lease, "interactive")
    row = publishing.AttemptRow(claim.history_row, 4.0, 120.5, 9.25, 66)
    facts = {"width": 4, "height": 3, "format": "jpeg", "bytes": 10}
    published = await publishing.publish(pool, photo_id, facts, "[]", (claim.token, "1-0"), row)
    assert (published.status, published.replaced) == ("published", [])
    [done] = await history.timeline(pool, photo_id)
    assert done["outcome"] == "published" and done["ended_at"] is not None
    assert (done["download_ms"], done["render_ms"], done["upload_ms"]) == (4.0, 120.5, 9.25)
    assert done["peak_rss_mb"] == 66 and 0 < done["publish_ms"] < 1000
    # a second delivery that lost the race (its lease token older than the publisher's):
    # its row stays `running` for the worker's end
    late = await history.start(pool, photo_id, "2-0", "w2", "interactive")
    late_row = publishing.AttemptRow(late, 1.0, 1.0, 1.0, 1)
    refused = await publishing.publish(
        pool, photo_id, facts, "[]", (claim.token - 1, "2-0"), late_row
    )
    assert refused.status != "published"
    stored = "SELECT outcome, ended_at IS NULL FROM photo_attempts WHERE id = $1"
    assert tuple(await pool.fetchrow(stored, late)) == ("running", True)


async def test_a_published_deliverys_row_stays_published_whatever_ends_it(pool: db.Pool) -> None:
    """Once the publish finished the row, a stop before the ack (`released`) or an ack
    that failed does not rewrite it; a delivery whose claim had no row of its own (an
    own re-claim whose row was finished already) gets a whole `published` row at its end."""
    rec = recorder.Recorder(pool, "w1")
    lease = leases.Lease("A", 60_000, 5)
    facts = {"width": 4, "height": 3, "format": "jpeg", "bytes": 10}
    for row_of_its_own, ending in ((True, "released"), (True, "retrying"), (False, "published")):
        photo_id = uuid.uuid4()
        await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
        entry = Entry("1-0", {"photo_id": str(photo_id)})
        claim = await leases.claim(pool, photo_id, entry.id, "w1", lease, "interactive")
        rec.begun(entry, claim.history_row if row_of_its_own else None)
        rec.attempt(entry).add("render", 12.0)
        lease_of = (claim.token, entry.id)
        published = await publishing.publish(
            pool, photo_id, facts, "[]", lease_of, rec.publishing(entry)
        )
        assert (published.status, published.replaced) == ("published", [])
        rec.published(entry)
        await rec.end(entry, history.Ending(ending))
        stored = await pool.fetch(
            "SELECT outcome, render_ms FROM photo_attempts WHERE photo_id = $1 ORDER BY id",
            photo_id,
        )
        finished = [tuple(r) for r in stored if r["outcome"] != "running"]
        assert finished == [("published", 12.0)], (row_of_its_own, ending)


async def test_a_publish_whose_reply_was_lost_leaves_its_row_published(pool: db.Pool) -> None:
    """The publishing statement committed but its reply never reached the worker (the
    connection dropped): the worker retries in place, finds the photo published, and ends
    the delivery `already`. The row says what happened: this delivery published it."""
    rec = recorder.Recorder(pool, "w1")
    lease = leases.Lease("A", 60_000, 5)
    facts = {"width": 4, "height": 3, "format": "jpeg", "bytes": 10}
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    entry = Entry("1-0", {"photo_id": str(photo_id)})
    claim = await leases.claim(pool, photo_id, entry.id, "w1", lease, "interactive")
    rec.begun(entry, claim.history_row)
    rec.attempt(entry).add("render", 12.0)
    lease_of = (claim.token, entry.id)
    published = await publishing.publish(
        pool, photo_id, facts, "[]", lease_of, rec.publishing(entry)
    )
    assert (published.status, published.replaced) == ("published", [])
    # the reply is lost: no rec.published(entry); the retry in place publishes nothing
    again = await publishing.publish(pool, photo_id, facts, "[]", lease_of, rec.publishing(entry))
    assert again.status == "already"
    await rec.end(entry, history.Ending("already"))
    [row] = await history.timeline(pool, photo_id)
    assert (row["outcome"], row["render_ms"]) == ("published", 12.0)


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_a_traced_claim_keeps_its_span_id_and_answers_the_dead_delivery_it_takes_over(
    pool: db.Pool,
) -> None:
    """A traced claim writes its delivery's span id on its row; a claim that takes the job
    from a delivery whose lease ran out answers that delivery's row (its span id, start,
    entry, lane, attempt, the photo's traceparent), once: the next takeover answers the
    delivery after it, through a new entry too (the sweep re-enqueued the job). Its own claim
    again, or a claim by a worker that does not trace, answers none; a dead delivery that
    did not trace has no span id to answer."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")

    async def claim(consumer: str, span_id: str | None, entry: str = "1-0") -> leases.Claim:
        lease = leases.Lease(consumer.upper(), 1, 9)  # run out at once: the worker is dead
        return await leases.claim(pool, photo_id, entry, consumer, lease, "bulk", None,
                                  TRACEPARENT, span_id)  # fmt: skip

    first = await claim("w1", "a" * 16)
    assert first.died is None
    assert (await claim("w1", "a" * 16)).died is None  # its own claim again: nobody died
    second = await claim("w2", "b" * 16)
    rows = await pool.fetch("SELECT * FROM photo_attempts WHERE photo_id = $1 ORDER BY id",
                            photo_id)  # fmt: skip
    assert [r["span_id"] for r in rows] == ["a" * 16, "b" * 16]
    assert second.died == leases.Died("a" * 16, rows[0]["started_at"], "1-0", "bulk", 1, "",
                                      TRACEPARENT)  # fmt: skip
    assert (await claim("w3", None)).died is None  # untraced: not even looked up
    assert (await claim("w4", "d" * 16)).died is None  # w3's row has no span to write
    fifth = await claim("w5", "e" * 16)
    assert fifth.died is not None and (fifth.died.span_id, fifth.died.attempt) == ("d" * 16, 4)
    await db.record_requeued(pool, photo_id, "2-0")  # the sweep: the job pending, a new entry
    sixth = await claim("w6", "f" * 16, "2-0")
    assert sixth.died is not None and (sixth.died.span_id, sixth.died.entry_id) == ("e" * 16, "1-0")


async def test_a_delivery_that_scheduled_its_retry_is_not_taken_for_dead(pool: db.Pool) -> None:
    """A retry leaves the job pending with its lease still running, and its row is ended
    just after: a claim of another entry for the photo in between (a duplicate delivered
    meanwhile) finds no dead delivery to write a span for, nor does a release's."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")

    async def claim(consumer: str, span_id: str, entry: str) -> leases.Claim:
        lease = leases.Lease(consumer.upper(), 60_000, 9)
        return await leases.claim(pool, photo_id, entry, consumer, lease, "bulk", None,
                                  TRACEPARENT, span_id)  # fmt: skip

    first = await claim("w1", "a" * 16, "1-0")
    assert await failures.record_retry(pool, photo_id, first.token, "timeout", "slow", 0)
    second = await claim("w2", "b" * 16, "2-0")
    assert second.outcome == "claimed" and second.died is None
    assert await leases.release(pool, photo_id, second.token)
    third = await claim("w3", "c" * 16, "3-0")
    assert third.outcome == "claimed" and third.died is None
