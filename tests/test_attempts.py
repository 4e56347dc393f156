"""What counts as an attempt, in PostgreSQL, against the real server: a claim
counts once per worker process, never while another consumer's live process holds the job,
and never past the run's cap; a stop gives the attempt back; the transient streak outlives
claims and ends with an outcome. Every claim grants the next fencing token, and a holder's
writes under an older one change nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from darkroom.store import db, failures, leases

MAX = 2


def lease(holder: str, ms: int = 60_000) -> leases.Lease:
    return leases.Lease(holder, ms, MAX)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    pool = await db.connect(database_url, 2)
    yield pool
    await pool.close()


async def new_photo(pool: db.Pool) -> uuid.UUID:
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    return photo_id


async def job(pool: db.Pool, photo_id: uuid.UUID) -> dict[str, Any]:
    row = await pool.fetchrow("SELECT * FROM photo_jobs WHERE photo_id = $1", photo_id)
    assert row is not None
    return dict(row)


async def expire(pool: db.Pool, photo_id: uuid.UUID) -> None:
    """The holder died: its lease ran out (what its stopped heartbeat leads to)."""
    await pool.execute(
        "UPDATE photo_jobs SET lease_until = now() - interval '1 s' WHERE photo_id = $1",
        photo_id,
    )


async def test_a_claim_by_the_same_process_counts_once(pool: db.Pool) -> None:
    """A lost reply or a reclaim of one's own entry claims again without counting, under
    the next fencing token all the same."""
    photo_id = await new_photo(pool)
    first = await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    again = await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    assert (first.outcome, first.attempt, first.counted, first.token) == ("claimed", 1, True, 1)
    assert (again.outcome, again.attempt, again.counted, again.token) == ("claimed", 1, False, 2)
    row = await job(pool, photo_id)
    assert (row["attempt"], row["lease_token"]) == (1, 2)


async def test_a_duplicate_entry_in_the_same_process_is_busy_not_a_second_render(
    pool: db.Pool,
) -> None:
    """A second entry of a photo this process is rendering (a producer's XADD and the
    intake's): `busy`, nothing counted, the job keeps its entry."""
    photo_id = await new_photo(pool)
    await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    dup = await leases.claim(pool, photo_id, "2-0", "w1", lease("A"))
    assert (dup.outcome, dup.last_entry, dup.attempt) == ("busy", "1-0", 0)
    row = await job(pool, photo_id)
    assert (row["attempt"], row["stream_entry"]) == (1, "1-0")


async def test_a_live_owner_is_neither_counted_nor_stolen_from(pool: db.Pool) -> None:
    """Another consumer reclaiming the entry while the owner's lease runs: `busy`, naming the
    owner; nothing changes. Once the lease has run out (the owner died) the claim counts."""
    photo_id = await new_photo(pool)
    await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    busy = await leases.claim(pool, photo_id, "1-0", "w2", lease("B"))
    assert (busy.outcome, busy.owner, busy.last_entry, busy.attempt) == ("busy", "w1", "1-0", 0)
    row = await job(pool, photo_id)
    assert (row["attempt"], row["holder"], row["consumer"]) == (1, "A", "w1")
    await expire(pool, photo_id)
    taken = await leases.claim(pool, photo_id, "1-0", "w2", lease("B"))
    assert (taken.outcome, taken.attempt, taken.counted) == ("claimed", 2, True)
    assert (await job(pool, photo_id))["holder"] == "B"


async def test_a_restart_under_the_same_consumer_name_counts_the_death(pool: db.Pool) -> None:
    """A stable consumer name restarted (a new process): the old process is dead whatever its
    lease says, so its claim counted an attempt and the new one proceeds."""
    photo_id = await new_photo(pool)
    await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    restarted = await leases.claim(pool, photo_id, "1-0", "w1", lease("A2"))
    assert (restarted.outcome, restarted.attempt, restarted.counted) == ("claimed", 2, True)


async def test_the_cap_is_checked_before_work_from_postgres(pool: db.Pool) -> None:
    """After MAX counted attempts the next claim is refused (`exhausted`, numbered MAX + 1)
    but takes the job, so that it (the owner) records the failure; an operator retry starts
    a new run with MAX more."""
    photo_id = await new_photo(pool)
    for n, holder in enumerate(("A", "B"), 1):
        assert (await leases.claim(pool, photo_id, "1-0", f"w{n}", lease(holder))).attempt == n
        await expire(pool, photo_id)
    refused = await leases.claim(pool, photo_id, "1-0", "w3", lease("C"))
    assert (refused.outcome, refused.attempt) == ("exhausted", MAX + 1)
    taken = await job(pool, photo_id)
    assert (taken["attempt"], taken["consumer"], taken["state"]) == (MAX + 1, "w3", "active")
    failed = await failures.record_failure(
        pool, photo_id, refused.token, "1-0", "attempts_exhausted", "x"
    )
    assert failed == "failed"
    assert await db.reset_failed(pool, photo_id)
    fresh = await leases.claim(pool, photo_id, "2-0", "w3", lease("C"))
    assert (fresh.outcome, fresh.attempt) == ("claimed", 1)
    assert (await job(pool, photo_id))["attempt"] == MAX + 2, "the history goes on"


async def test_a_stop_gives_the_attempt_back(pool: db.Pool) -> None:
    """Released by its holder (a stop cut the work short), the job is pending again with the
    attempt undone, so the next claim is attempt 1 again; a release under an older token
    (here the first of two claims of the same entry: a lost reply) changes nothing."""
    photo_id = await new_photo(pool)
    first = await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    second = await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    assert not await leases.release(pool, photo_id, first.token)
    assert (await job(pool, photo_id))["state"] == "active"
    assert await leases.release(pool, photo_id, second.token)
    row = await job(pool, photo_id)
    assert (row["state"], row["attempt"]) == ("pending", 0)
    again = await leases.claim(pool, photo_id, "1-0", "w2", lease("B"))
    assert (again.outcome, again.attempt, again.counted) == ("claimed", 1, True)


async def test_the_transient_streak_outlives_claims_and_ends_with_an_outcome(
    pool: db.Pool,
) -> None:
    """The streak starts once and keeps its start across a reclaim by another process; an
    outage restarts it; a counted failure (a retry, recorded only under the job's current
    token) ends it. The old holder's token, after the reclaim, neither reads nor ends it."""
    photo_id = await new_photo(pool)
    a = await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    assert await leases.transient_streak_s(pool, photo_id, 0, restart=False) is None
    assert await leases.transient_streak_s(pool, photo_id, a.token, restart=False) == 0
    await pool.execute("UPDATE photo_jobs SET transient_since = transient_since - interval '100 s'")
    await expire(pool, photo_id)
    b = await leases.claim(pool, photo_id, "1-0", "w2", lease("B"))
    assert await leases.transient_streak_s(pool, photo_id, a.token, restart=True) is None
    age_s = await leases.transient_streak_s(pool, photo_id, b.token, restart=False)
    assert age_s is not None and 100 <= age_s < 110
    assert await leases.transient_streak_s(pool, photo_id, b.token, restart=True) == 0
    assert not await failures.record_retry(pool, photo_id, a.token, "timeout", "x", 1000)
    assert await failures.record_retry(pool, photo_id, b.token, "timeout", "slow", 1000)
    assert (await job(pool, photo_id))["transient_since"] is None


async def test_the_heartbeat_renews_only_its_own_leases(pool: db.Pool) -> None:
    """renew_leases moves on each lease whose token is still the job's, and names them; a
    job claimed since by another process (its token moved on) keeps that process's lease."""
    mine, theirs = await new_photo(pool), await new_photo(pool)
    kept = await leases.claim(pool, mine, "1-0", "w1", lease("A", ms=1))
    lost = await leases.claim(pool, theirs, "2-0", "w1", lease("A", ms=1))
    await expire(pool, theirs)
    await leases.claim(pool, theirs, "2-0", "w2", lease("B", ms=1))
    renewed = await leases.renew_leases(
        pool, lease("A"), [(mine, kept.token), (theirs, lost.token)]
    )
    assert renewed == {mine}
    alive = "SELECT photo_id FROM photo_jobs WHERE lease_until > now() + interval '50 s'"
    assert [r["photo_id"] for r in await pool.fetch(alive)] == [mine]


TAKE_OVER = {
    # the job did not exist when the waiting claim's statement began
    "created": "INSERT INTO photo_jobs (photo_id, state, attempt, stream_entry, consumer, holder,"
    " lease_until) VALUES ($1, 'active', 1, '1-0', 'w1', 'A', now() + interval '1 min')",
    # it existed (pending) and was claimed meanwhile
    "claimed": "UPDATE photo_jobs SET state = 'active', attempt = 1, stream_entry = '1-0',"
    " consumer = 'w1', holder = 'A', lease_until = now() + interval '1 min' WHERE photo_id = $1",
}


@pytest.mark.parametrize("how", TAKE_OVER)
async def test_a_claim_that_waited_for_the_photo_sees_the_job_as_it_is_now(
    pool: db.Pool, database_url: str, how: str
) -> None:
    """A claim blocked on the photo while another process claimed the job: it sees that
    claim (it neither overwrites it nor counts) and steps aside, naming the owner when it
    can read it."""
    photo_id = await new_photo(pool)
    if how == "claimed":
        await db.record_requeued(pool, photo_id, "0-1")  # a pending job
    other = await asyncpg.connect(database_url)
    try:
        async with other.transaction():
            await other.execute("SELECT 1 FROM photos WHERE id = $1 FOR UPDATE", photo_id)
            waiting = asyncio.create_task(leases.claim(pool, photo_id, "2-0", "w2", lease("B")))
            await asyncio.sleep(0.2)  # the claim's statement began before this commit
            assert not waiting.done()
            await other.execute(TAKE_OVER[how], photo_id)
        late = await waiting
    finally:
        await other.close()
    assert (late.outcome, late.owner) == ("busy", "w1" if how == "claimed" else None)
    row = await job(pool, photo_id)
    assert (row["attempt"], row["holder"], row["stream_entry"]) == (1, "A", "1-0")


async def test_a_requeue_leaves_a_live_owners_job_alone(pool: db.Pool) -> None:
    """`darkroom enqueue` (or the sweep) while a live worker holds the job: the job stays
    active under its entry, so the new entry meets it as `busy` instead of rendering the
    photo beside it; once the owner is gone, a requeue points the job at the new entry."""
    photo_id = await new_photo(pool)
    await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    await db.record_requeued(pool, photo_id, "2-0")
    row = await job(pool, photo_id)
    assert (row["state"], row["stream_entry"], row["holder"]) == ("active", "1-0", "A")
    busy = await leases.claim(pool, photo_id, "2-0", "w2", lease("B"))
    assert (busy.outcome, busy.attempt) == ("busy", 0)
    await expire(pool, photo_id)
    await db.record_requeued(pool, photo_id, "3-0")
    row = await job(pool, photo_id)
    assert (row["state"], row["stream_entry"]) == ("pending", "3-0")


async def test_a_stale_rerender_failure_leaves_the_entry_to_its_new_owner(
    pool: db.Pool,
) -> None:
    """A worker that lost a re-render's entry to another consumer finds its failure refused
    (its token is older than the job's) and the re-render held elsewhere: it must not ack
    the entry the new owner works on."""
    photo_id = await new_photo(pool)
    await pool.execute(
        "UPDATE photos SET processing_state = 'processed', visibility = 'published',"
        " renditions = '[]', processed_at = now(), rerender_requested_at = now()"
        " WHERE id = $1",
        photo_id,
    )
    old = await leases.claim(pool, photo_id, "1-0", "w1", lease("A"))
    await expire(pool, photo_id)
    new = await leases.claim(pool, photo_id, "1-0", "w2", lease("B"))
    failed = await failures.record_failure(pool, photo_id, old.token, "1-0", "timeout", "x")
    assert failed == "finished"
    rerender = await failures.record_rerender_failure(pool, photo_id, old.token, "timeout", "x")
    assert rerender == "not_recorded"
    assert await leases.leave_or_drop(pool, photo_id, old.token, "1-0") == "left"
    assert await leases.leave_or_drop(pool, photo_id, old.token, "2-0") == "dropped"
    await failures.record_retry(pool, photo_id, new.token, "timeout", "slow", 1000)
    assert await leases.leave_or_drop(pool, photo_id, old.token, "1-0") == "left", "pending"
    dropped = await pool.fetchval("SELECT dropped_entries FROM photo_jobs")
    assert dropped == ["2-0"]  # the entry it left is not noted: its holder still needs it
