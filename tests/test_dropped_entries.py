"""Entries acked without their job finishing through them take no job later: a worker that
read such an entry and stalled before its claim (the entry was reclaimed from it meanwhile,
then acked) must not hold the job under an entry gone from the stream, where no reclaim
finds it and the request's own entry, meeting that lease, is acked as a duplicate
(`photo_jobs.dropped_entries`, docs/reliability.md)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from darkroom.store import audit, db, failures, leases, pauses, publishing, upgrading
from tests.test_fencing import FACTS, LONG, processed

EXPIRE = "UPDATE photo_jobs SET lease_until = now() - interval '1 second'"


def lease(holder: str) -> leases.Lease:
    return leases.Lease(holder, 60_000, 5)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    pool = await db.connect(database_url, 3)
    yield pool
    await pool.close()


async def claimed(pool: db.Pool, photo_id: uuid.UUID, entry: str, holder: str,
                  lane: str | None = None) -> str:  # fmt: skip
    """The outcome of a claim through `entry` by a worker of its own (`holder`)."""
    claim = await leases.claim(pool, photo_id, entry, f"w-{holder}", lease(holder), lane=lane)
    return claim.outcome


async def test_an_entry_acked_as_a_duplicate_takes_nothing_from_its_stale_reader(
    pool: db.Pool,
) -> None:
    """A worker reads a bulk entry and stalls; another reclaims it, finds a live lease
    holding the job through the photo's other entry, and acks it as a duplicate. The live
    holder then stalls past its lease. The first worker wakes and claims the acked entry:
    `already`, not the job (under an entry gone from the stream no reclaim would find it);
    the holder's entry, still pending, is the one that takes it."""
    photo_id = await processed(pool, "bulk", "t")
    await publishing.request_rerender(pool, [photo_id], None)
    held = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    assert held.outcome == "claimed"
    duplicate = await leases.claim(pool, photo_id, "3-0", "w2", lease("B"))
    assert (duplicate.outcome, duplicate.owner, duplicate.last_entry) == ("busy", "w1", "2-0")
    await pool.execute("UPDATE photo_jobs SET lease_until = now() - interval '1 second'")
    assert await claimed(pool, photo_id, "3-0", "C") == "already"
    reclaimed = await leases.claim(pool, photo_id, "2-0", "w4", lease("D"))
    assert reclaimed.outcome == "claimed" and reclaimed.token > held.token


async def test_an_entry_acked_for_a_finished_photo_starts_no_later_request(pool: db.Pool) -> None:
    """An entry of a processed photo is acked `already`; a re-render is requested; a worker
    that read that entry before and claims it now takes nothing: the request's own entry
    does."""
    photo_id = await processed(pool)
    assert await claimed(pool, photo_id, "5-0", "B") == "already"
    await publishing.request_rerender(pool, [photo_id], None)
    assert await claimed(pool, photo_id, "5-0", "C") == "already"
    assert await claimed(pool, photo_id, "6-0", "D") == "claimed"


async def test_an_entry_left_pending_by_a_pause_still_takes_the_job_later(pool: db.Pool) -> None:
    """A pause leaves an entry pending (not acked) even where a live lease holds the job
    through another entry: once the pause ends and that lease runs out, the entry takes the
    job as any reclaim does."""
    photo_id = await processed(pool, "bulk", "t")
    await publishing.request_rerender(pool, [photo_id], None)
    held = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    assert held.outcome == "claimed"
    action = audit.Action(operator="test", via="cli", action="pause", reason="a test")
    await pauses.pause(pool, action, ("bulk", None), None)
    assert await claimed(pool, photo_id, "3-0", "B") == "paused"
    await pauses.resume(pool, action, ("bulk", None))
    await pool.execute("UPDATE photo_jobs SET lease_until = now() - interval '1 second'")
    assert await claimed(pool, photo_id, "3-0", "B") == "claimed"


async def test_an_entry_acked_after_a_refused_publish_takes_nothing_from_its_stale_reader(
    pool: db.Pool,
) -> None:
    """A holder stalls past its lease; the photo's other entry takes the job; the stale
    holder's publish is refused (`already`: the job is another entry's) and its entry acked.
    A third worker that read that entry before and claims it once the new lease has run out
    too takes nothing: the new holder's entry, still pending, does."""
    photo_id = await processed(pool, "bulk", "t")
    await publishing.request_rerender(pool, [photo_id], None)
    first = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    expire = "UPDATE photo_jobs SET lease_until = now() - interval '1 second'"
    await pool.execute(expire)
    assert await claimed(pool, photo_id, "3-0", "B") == "claimed"
    refused = await publishing.publish(pool, photo_id, FACTS, "[]", (first.token, "2-0"))
    assert refused.status == "already"
    await pool.execute(expire)
    assert await claimed(pool, photo_id, "2-0", "C") == "already"
    assert await claimed(pool, photo_id, "3-0", "D") == "claimed"


async def test_an_entry_whose_rerender_failed_for_good_starts_no_later_request(
    pool: db.Pool,
) -> None:
    """A re-render fails for good through an entry (its job `failed`, the entry acked); a
    request comes; the entry's stale reader takes nothing."""
    photo_id = await processed(pool, "bulk", "t")
    await publishing.request_rerender(pool, [photo_id], None)
    run = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    failed = await failures.record_rerender_failure(pool, photo_id, run.token, "timeout", "x")
    assert failed == "answered"
    await publishing.request_rerender(pool, [photo_id], None)
    assert await claimed(pool, photo_id, "2-0", "B") == "already"
    assert await claimed(pool, photo_id, "3-0", "C") == "claimed"


async def test_an_entry_of_an_earlier_run_starts_nothing_once_a_later_run_replaced_it(
    pool: db.Pool,
) -> None:
    """Run 1 publishes through 2-0, run 2 through 3-0 (the job now names 3-0), a third
    request comes: 2-0's stale reader takes nothing."""
    photo_id = await processed(pool, "bulk", "t")
    for entry in ("2-0", "3-0"):
        await publishing.request_rerender(pool, [photo_id], None)
        run = await leases.claim(pool, photo_id, entry, "w1", LONG)
        done = await publishing.publish(pool, photo_id, FACTS, "[]", (run.token, entry))
        assert done.status == "published"
    await publishing.request_rerender(pool, [photo_id], None)
    for entry in ("2-0", "3-0", "1-0"):
        stale = await leases.claim(pool, photo_id, entry, "w2", lease("B"))
        assert stale.outcome == "already", entry


async def test_an_entry_acked_after_its_failure_was_refused_starts_nothing(pool: db.Pool) -> None:
    """A re-render's holder stalls past its lease; the photo's other entry takes the job and
    publishes; the stale holder's failure is refused and its entry acked (`dropped`); a
    request comes; that entry's stale reader takes nothing."""
    photo_id = await processed(pool, "bulk", "t")
    await publishing.request_rerender(pool, [photo_id], None)
    stalled = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    await pool.execute(EXPIRE)
    other = await leases.claim(pool, photo_id, "3-0", "w2", lease("B"))
    done = await publishing.publish(pool, photo_id, FACTS, "[]", (other.token, "3-0"))
    assert done.status == "published"
    refused = await failures.record_failure(pool, photo_id, stalled.token, "2-0", "x", "y")
    assert refused == "finished"
    not_recorded = await failures.record_rerender_failure(pool, photo_id, stalled.token, "x", "y")
    assert not_recorded == "not_recorded"
    assert await leases.leave_or_drop(pool, photo_id, stalled.token, "2-0") == "dropped"
    await publishing.request_rerender(pool, [photo_id], None)
    assert await claimed(pool, photo_id, "2-0", "C") == "already"


async def test_an_upgrade_reclaimed_from_a_stalled_holder_is_left_to_its_new_holder(
    pool: db.Pool,
) -> None:
    """An upgrade's holder stalls past its lease, another worker reclaims the same bulk
    entry and claims it; the stalled holder's encode fails for good, its failure is not
    recorded, and the entry is left to the new holder (not acked under its lease)."""
    photo_id = await processed(pool)
    await pool.execute("UPDATE photos SET upgrade_requested_at = now()")
    stalled = await leases.claim(pool, photo_id, "7-0", "w1", LONG, lane="bulk")
    assert (stalled.outcome, stalled.upgrade) == ("claimed", True)
    await pool.execute(EXPIRE)
    assert await claimed(pool, photo_id, "7-0", "B", "bulk") == "claimed"
    failed = await upgrading.record_upgrade_failure(pool, photo_id, stalled.token, "x", "y")
    assert failed == "not_recorded"
    assert await leases.leave_or_drop(pool, photo_id, stalled.token, "7-0") == "left"
    assert "7-0" not in await pool.fetchval("SELECT dropped_entries FROM photo_jobs")


async def test_a_publish_refused_while_a_claim_took_the_job_through_its_entry_leaves_it(
    pool: db.Pool,
) -> None:
    """A stalled holder's publish waits for the photo's lock while another worker's claim
    through the same entry commits; the job named another entry when the publish began. The
    publish answers `lost` (the entry is the new holder's to ack), read from the job as it
    is once locked, not as its snapshot saw it."""
    photo_id = await processed(pool, "bulk", "t")
    await publishing.request_rerender(pool, [photo_id], None)
    stalled = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    await pool.execute(EXPIRE)
    assert await claimed(pool, photo_id, "3-0", "B") == "claimed"
    await pool.execute(EXPIRE)
    async with pool.acquire() as conn, conn.transaction():
        taken = await leases.claim(conn, photo_id, "2-0", "w3", lease("C"))
        assert taken.outcome == "claimed"
        publish = asyncio.ensure_future(
            publishing.publish(pool, photo_id, FACTS, "[]", (stalled.token, "2-0"))
        )
        await asyncio.sleep(0.5)  # the publish now waits for the photo's lock
        assert not publish.done()
    refused = await publish
    assert refused.status == "lost"
    # only the first run's entry, acked with its publish: not the one the job is under
    assert await pool.fetchval("SELECT dropped_entries FROM photo_jobs") == ["1-0"]


async def test_a_failed_photos_entry_takes_nothing_once_an_operator_retried_it(
    pool: db.Pool,
) -> None:
    """A photo fails for good through an entry; an operator retries it (a new run); a worker
    that read the failed run's entry before takes nothing: the retry's own entry does."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, "originals/x.jpg")
    run = await leases.claim(pool, photo_id, "2-0", "w1", LONG)
    failed = await failures.record_failure(pool, photo_id, run.token, "2-0", "x", "y")
    assert failed == "failed"
    assert await db.reset_failed(pool, photo_id)
    assert await pool.fetchval("SELECT dropped_entries FROM photo_jobs") == ["2-0"]
    stale = await leases.claim(pool, photo_id, "2-0", "w2", lease("B"))
    assert (stale.outcome, stale.state) == ("already", "uploaded")
    assert await claimed(pool, photo_id, "3-0", "C") == "claimed"


async def test_an_upgrade_entry_acked_after_a_refused_upgrade_takes_nothing(pool: db.Pool) -> None:
    """An upgrade's holder stalls past its lease; a second upgrade entry of the photo takes
    the job; the stale holder's upgrade is refused (`already`) and its entry acked; that
    entry's stale reader takes nothing once the second lease has run out too."""
    photo_id = await processed(pool)
    await pool.execute("UPDATE photos SET upgrade_requested_at = now()")
    stalled = await leases.claim(pool, photo_id, "7-0", "w1", LONG, lane="bulk")
    await pool.execute(EXPIRE)
    second = await leases.claim(pool, photo_id, "8-0", "w2", lease("B"), lane="bulk")
    assert (second.outcome, second.upgrade) == ("claimed", True)
    refused = await upgrading.publish_upgrade(pool, photo_id, "[]", (stalled.token, "7-0"))
    assert refused.status == "already"
    await pool.execute(EXPIRE)
    assert await claimed(pool, photo_id, "7-0", "C", "bulk") == "already"
    assert await claimed(pool, photo_id, "8-0", "D", "bulk") == "claimed"
