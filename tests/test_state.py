"""The state machine in Postgres and the sweeper, driven directly against the real servers."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio

from darkroom import sweeper
from darkroom.queue.streams import Streams
from darkroom.store import db, duties, failures, leases, publishing
from tests.conftest import PHOTOS, REDIS_URL, Env


@dataclass
class Store:
    pool: db.Pool
    streams: Streams


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    tag = uuid.uuid4().hex[:10]
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, f"{{s{tag}}}:photos", "darkroom", "t", f"{{s{tag}}}:dead")
    pool = await db.connect(database_url, 4)
    await streams.ensure_group()
    yield Store(pool, streams)
    await client.delete(streams.stream, streams.dead_stream)
    await client.aclose()
    await pool.close()


async def new_photo(pool: db.Pool, age_s: int = 0) -> uuid.UUID:
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
    await pool.execute(
        "UPDATE photos SET updated_at = now() - make_interval(secs => $2),"
        " last_activity_at = now() - make_interval(secs => $2) WHERE id = $1",
        photo_id,
        age_s,
    )
    return photo_id


FACTS = {"width": 10, "height": 10, "format": "jpeg", "bytes": 1}


async def test_a_stale_worker_cannot_publish_a_failed_photo(store: Store) -> None:
    """Claim, claim again, fail: the first worker's late publish or failure (under its older
    token) changes nothing."""
    photo_id = await new_photo(store.pool)
    first = await leases.claim(store.pool, photo_id, "1-0", "w1")
    assert first.outcome == "claimed"
    second = await leases.claim(store.pool, photo_id, "1-0", "w2")
    assert second.attempt == 2
    failed = await failures.record_failure(
        store.pool, photo_id, second.token, "1-0", "timeout", "slow"
    )
    assert failed == "failed"
    published = await publishing.publish(store.pool, photo_id, FACTS, "[]", (first.token, "1-0"))
    assert published.status == "already"
    late = await failures.record_failure(
        store.pool, photo_id, first.token, "1-0", "storage_unavailable", "late"
    )
    assert late == "finished"
    code = await store.pool.fetchval("SELECT error_code FROM photos WHERE id = $1", photo_id)
    assert code == "timeout", "a late failure of another delivery does not rewrite the code"
    row = await store.pool.fetchrow(
        "SELECT p.processing_state, p.visibility, j.state FROM photos p"
        " JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = $1",
        photo_id,
    )
    assert tuple(row) == ("processing_failed", "unpublished", "failed")


async def test_a_stale_entry_cannot_retry_or_fail_a_photo_another_entry_owns(store: Store) -> None:
    """Once the photo was re-enqueued through a newer entry and claimed through it, the old
    entry's retry and final failure (under its older token) change nothing, the failure
    answering `finished` (the job goes through another entry); the newer claim's do."""
    photo_id = await new_photo(store.pool)
    old = await leases.claim(store.pool, photo_id, "1-0", "w1")
    await db.record_requeued(store.pool, photo_id, "2-0")
    new = await leases.claim(store.pool, photo_id, "2-0", "w2")
    assert not await failures.record_retry(store.pool, photo_id, old.token, "timeout", "late", 1000)
    stale = await failures.record_failure(
        store.pool, photo_id, old.token, "1-0", "attempts_exhausted", "x"
    )
    assert stale == "finished"
    row = await store.pool.fetchrow(
        "SELECT p.processing_state, j.state, j.error_code FROM photos p"
        " JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = $1",
        photo_id,
    )
    assert tuple(row) == ("processing", "active", None)
    assert await failures.record_retry(store.pool, photo_id, new.token, "timeout", "slow", 1000)
    again = await leases.claim(store.pool, photo_id, "2-0", "w2")
    failed = await failures.record_failure(
        store.pool, photo_id, again.token, "2-0", "timeout", "slow"
    )
    assert failed == "failed"


async def test_only_the_current_token_of_the_job_records_its_failure(store: Store) -> None:
    """A delivery that never claimed (token 0), or whose token is older than the job's (its
    entry reclaimed and claimed again by another consumer), records no failure: `not_owner`,
    nothing changes; the holder of the job's current token does."""
    photo_id = await new_photo(store.pool)
    unclaimed = await failures.record_failure(store.pool, photo_id, 0, "1-0", "timeout", "early")
    assert unclaimed == "not_owner"
    w1 = await leases.claim(store.pool, photo_id, "1-0", "w1")
    w2 = await leases.claim(store.pool, photo_id, "1-0", "w2")  # w2 reclaimed the entry
    lost = await failures.record_failure(
        store.pool, photo_id, w1.token, "1-0", "corrupt_image", "late"
    )
    assert lost == "not_owner"
    row = await store.pool.fetchrow(
        "SELECT p.processing_state, p.error_code, j.state, j.consumer, j.last_error"
        " FROM photos p JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = $1",
        photo_id,
    )
    assert tuple(row) == ("processing", None, "active", "w2", None)
    failed = await failures.record_failure(store.pool, photo_id, w2.token, "1-0", "timeout", "slow")
    assert failed == "failed"


async def test_publish_happens_once_and_keeps_processed_at(store: Store) -> None:
    """Two publishes of one claim: the second is refused, processed_at is kept."""
    photo_id = await new_photo(store.pool)
    lease = ((await leases.claim(store.pool, photo_id, "1-0", "w1")).token, "1-0")
    published = await publishing.publish(store.pool, photo_id, FACTS, "[]", lease)
    assert (published.status, published.replaced) == ("published", []), "it replaced nothing"
    first = await store.pool.fetchval("SELECT processed_at FROM photos WHERE id = $1", photo_id)
    assert (await publishing.publish(store.pool, photo_id, FACTS, "[]", lease)).status == "already"
    claim = await leases.claim(store.pool, photo_id, "2-0", "w2")
    assert (claim.outcome, claim.state) == ("already", "processed")
    again = await store.pool.fetchval("SELECT processed_at FROM photos WHERE id = $1", photo_id)
    assert again == first


async def test_a_rerender_publish_returns_the_keys_it_replaced(store: Store) -> None:
    """A re-render's publish switches the row to the new keys and returns the old ones (to
    delete after the commit); a duplicate publish of it is refused and returns nothing."""
    photo_id = await new_photo(store.pool)
    first = await leases.claim(store.pool, photo_id, "1-0", "w1")
    old = [{"key": "renditions/x/thumb.webp"}, {"key": "renditions/x/large-1.webp"}]
    await publishing.publish(store.pool, photo_id, FACTS, json.dumps(old), (first.token, "1-0"))
    assert await publishing.request_rerender(store.pool, [photo_id], None) == [photo_id]
    claim = await leases.claim(store.pool, photo_id, "2-0", "w1")
    assert claim.outcome == "claimed"
    new = json.dumps([{"key": "renditions/x/large-1.webp"}, {"key": "renditions/x/thumb-2.webp"}])
    lease = (claim.token, "2-0")
    published = await publishing.publish(store.pool, photo_id, FACTS, new, lease)
    assert published.status == "published"
    assert published.replaced == ["renditions/x/thumb.webp", "renditions/x/large-1.webp"]
    duplicate = await publishing.publish(store.pool, photo_id, FACTS, new, lease)
    assert (duplicate.status, duplicate.replaced) == ("already", [])
    row = await store.pool.fetchval("SELECT renditions::text FROM photos WHERE id = $1", photo_id)
    assert json.loads(row) == json.loads(new)


async def test_sweep_pages_through_every_lost_photo(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sweep finds every lost photo, however many pages; the next finds none."""
    monkeypatch.setattr(sweeper, "BATCH", 2)
    lost = {await new_photo(store.pool, age_s=600) for _ in range(5)}
    fresh = await new_photo(store.pool, age_s=0)
    assert set(await sweeper.sweep(store.pool, store.streams, 60)) == lost
    entries = await store.streams.client.xrange(store.streams.stream)  # raw: see RAW_READS
    queued = {dict(zip(f[::2], f[1::2], strict=True))["photo_id"] for _, f in entries}
    assert queued == {str(p) for p in lost} and str(fresh) not in queued
    assert await sweeper.sweep(store.pool, store.streams, 60) == []


async def test_sweep_leaves_photos_queued_behind_a_backlog(store: Store) -> None:
    """A stale photo is not enqueued again while older entries still wait in the stream."""
    await store.streams.enqueue({"photo_id": str(uuid.uuid4())})  # an old backlog entry
    await store.pool.execute("SELECT pg_sleep(0.01)")
    photo_id = await new_photo(store.pool, age_s=0)
    await store.pool.execute(
        "UPDATE photos SET last_activity_at = now() + interval '1 minute' WHERE id = $1", photo_id
    )  # last activity after the backlog entry: it may well be queued behind it
    assert await sweeper.sweep(store.pool, store.streams, -3600) == []


async def test_sweep_runs_one_at_a_time(store: Store) -> None:
    """While another process holds the sweep's duty, a sweep does nothing; once that
    holder lets it go, the next sweep runs."""
    await new_photo(store.pool, age_s=600)
    token = await duties.acquire(store.pool, duties.SWEEP, "another-worker", 30)
    assert token is not None
    assert await sweeper.sweep(store.pool, store.streams, 60) == []
    assert await duties.release(store.pool, duties.Fence(duties.SWEEP, "another-worker", token))
    assert len(await sweeper.sweep(store.pool, store.streams, 60)) == 1


def test_failure_whose_dead_letter_was_never_written_gets_it(file_env: Env, tmp_path: Path) -> None:
    """Failure committed, then the worker died before its dead letter: the redelivery writes it."""
    broken = tmp_path / "broken.jpg"
    broken.write_bytes((PHOTOS / "Landscape_1.jpg").read_bytes()[:5000])
    [photo_id] = file_env.ingest([broken])
    [[_, [(entry_id, _)]]] = file_env.redis.xreadgroup("darkroom", "ghost", {file_env.stream: ">"})
    # The ghost claims and records the failure, as a worker would, then dies.
    file_env.query(
        leases.CLAIM_SQL, photo_id, entry_id, "ghost", *leases.NO_LEASE.args, *[None] * 4
    )
    file_env.query("UPDATE photos SET processing_state = 'processing_failed', "
                   "error_code = 'corrupt_image' WHERE id = $1", photo_id)  # fmt: skip
    file_env.query("UPDATE photo_jobs SET state = 'failed', error_code = 'corrupt_image', "
                   "last_error = 'cut short' WHERE photo_id = $1", photo_id)  # fmt: skip
    log = file_env.cli("run", "--drain", DARKROOM_CLAIM_IDLE_MS="1000").stderr
    assert '"outcome": "failed"' in log
    [(_, letter)] = file_env.redis.xrange(file_env.dead)
    assert (letter["photo_id"], letter["error_code"], letter["source_id"]) == (
        str(photo_id), "corrupt_image", entry_id)  # fmt: skip
    assert file_env.redis.xlen(file_env.stream) == 0


def test_failed_photo_past_the_cap_keeps_its_code_and_single_letter(file_env: Env) -> None:
    """A failed photo's entry delivered past the cap is acked, not re-failed as exhausted."""
    [photo_id] = file_env.ingest([PHOTOS / "4.webp"])
    [[_, [(entry_id, _)]]] = file_env.redis.xreadgroup("darkroom", "ghost", {file_env.stream: ">"})
    for _ in range(3):  # delivered again and again without finishing
        file_env.redis.xclaim(file_env.stream, "darkroom", "ghost", 0, [entry_id])
    [claim] = file_env.query(
        leases.CLAIM_SQL,
        photo_id,
        "another-entry",
        "ghost",
        *leases.NO_LEASE.args,
        *[None] * 4,
    )
    file_env.query(failures.FAIL_SQL, photo_id, "corrupt_image", "failed through another entry",
                   claim["lease_token"], "another-entry")  # fmt: skip
    log = file_env.cli("run", "--drain", DARKROOM_MAX_ATTEMPTS="2",
                       DARKROOM_CLAIM_IDLE_MS="1000").stderr  # fmt: skip
    assert '"outcome": "already"' in log
    row = file_env.query("SELECT processing_state, error_code FROM photos")[0]
    assert (row["processing_state"], row["error_code"]) == ("processing_failed", "corrupt_image")
    assert file_env.redis.xlen(file_env.dead) == 0 and file_env.redis.xlen(file_env.stream) == 0
