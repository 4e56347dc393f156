"""The sweep at scale: keyset pages over (last_activity_at, id), each photo read once per
pass, every state change moving last_activity_at, the plan using the index, and the
migration of a database that predates the column. Real PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest
import redis.asyncio

from darkroom import metrics, sweeper
from darkroom.queue.streams import Streams
from darkroom.store import db, failures, leases, publishing
from tests.conftest import REDIS_URL

FACTS = {"width": 10, "height": 10, "format": "jpeg", "bytes": 1}


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    pool = await db.connect(database_url, 4)
    yield pool
    await pool.close()


@pytest.fixture
async def streams() -> AsyncIterator[Streams]:
    tag = uuid.uuid4().hex[:10]
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    streams = Streams(client, f"{{w{tag}}}:photos", "darkroom", "t", f"{{w{tag}}}:dead")
    await streams.ensure_group()
    yield streams
    await client.delete(streams.stream, streams.dead_stream)
    await client.aclose()


async def photo_at(pool: db.Pool, at: datetime, entry: str | None = None) -> uuid.UUID:
    """An unfinished photo whose last activity is `at`, with a job through `entry` if given."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
    if entry is not None:
        await db.record_requeued(pool, photo_id, entry)
    await pool.execute("UPDATE photos SET last_activity_at = $2 WHERE id = $1", photo_id, at)
    return photo_id


async def test_sweep_reads_each_photo_once_across_pages_with_equal_timestamps(
    pool: db.Pool, streams: Streams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of 3 over 10 photos, 7 sharing one timestamp: every photo is read exactly once,
    in (last_activity_at, id) order, and only those whose entry is gone (deleted, or never
    written) are re-enqueued."""
    monkeypatch.setattr(sweeper, "BATCH", 3)
    now = await pool.fetchval("SELECT now()")
    older, tied = now - timedelta(hours=2), now - timedelta(hours=1)
    kept = [await photo_at(pool, t, await streams.enqueue({"photo_id": "x"})) for t in [tied] * 4]
    lost = [await photo_at(pool, t) for t in [older] * 3 + [tied] * 2]  # never delivered
    gone = await streams.enqueue({"photo_id": "x"})
    await streams.client.xdel(streams.stream, gone)
    lost.append(await photo_at(pool, tied, gone))  # its entry is no longer in the stream
    pages: list[list[uuid.UUID]] = []
    stale_photos = db.stale_photos

    async def recording(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        rows = await stale_photos(*args, **kwargs)
        pages.append([row["id"] for row in rows])
        return rows

    monkeypatch.setattr(db, "stale_photos", recording)
    scanned = metrics.SWEEP_SCANNED._value.get()
    assert sorted(await sweeper.sweep(pool, streams, 60)) == sorted(lost)
    assert [len(page) for page in pages] == [3, 3, 3, 1, 0]
    read = [photo_id for page in pages for photo_id in page]
    assert read == sorted(lost[:3]) + sorted(kept + lost[3:]), "keyset order, ties on id"
    assert metrics.SWEEP_SCANNED._value.get() - scanned == 10


async def test_a_pass_is_timed(pool: db.Pool, streams: Streams) -> None:
    """darkroom_sweep_seconds counts each full pass."""
    before = metrics.SWEEP_SECONDS._sum.get(), _count(metrics.SWEEP_SECONDS)
    await sweeper.sweep(pool, streams, 60)
    assert _count(metrics.SWEEP_SECONDS) == before[1] + 1
    assert metrics.SWEEP_SECONDS._sum.get() > before[0]


def _count(histogram: Any) -> float:
    return float(sum(bucket.get() for bucket in histogram._buckets))


async def aged(pool: db.Pool, photo_id: uuid.UUID) -> None:
    await pool.execute(
        "UPDATE photos SET last_activity_at = now() - interval '1 hour' WHERE id = $1", photo_id
    )


async def moved(pool: db.Pool, photo_id: uuid.UUID) -> bool:
    sql = "SELECT last_activity_at > now() - interval '1 minute' FROM photos WHERE id = $1"
    return bool(await pool.fetchval(sql, photo_id))


async def test_every_state_change_moves_last_activity(pool: db.Pool) -> None:
    """Claim, retry, requeue, failure, reset and publish each set last_activity_at."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, "originals/x")
    assert await moved(pool, photo_id), "a new photo starts with now()"
    claims: list[leases.Claim] = []

    async def claim(entry: str) -> None:
        claims.append(await leases.claim(pool, photo_id, entry, "w"))

    def token() -> int:  # the last claim's, read when its change runs
        return claims[-1].token

    changes = [
        (lambda: claim("1-0"), "processing"),
        (
            lambda: failures.record_retry(pool, photo_id, token(), "timeout", "slow", 1000),
            "processing",
        ),
        (lambda: db.record_requeued(pool, photo_id, "2-0"), "processing"),
        (lambda: claim("2-0"), "processing"),
        (
            lambda: failures.record_failure(pool, photo_id, token(), "2-0", "corrupt_image", "bad"),
            "processing_failed",
        ),
        (lambda: db.reset_failed(pool, photo_id), "uploaded"),
        (lambda: claim("3-0"), "processing"),
        (lambda: publishing.publish(pool, photo_id, FACTS, "[]", (token(), "3-0")), "processed"),
    ]
    for change, state in changes:
        await aged(pool, photo_id)
        await change()
        assert await db.photo_state(pool, photo_id) == state
        assert await moved(pool, photo_id), state
    job = "SELECT state FROM photo_jobs WHERE photo_id = $1"
    assert await pool.fetchval(job, photo_id) == "done"


async def test_a_retry_does_not_wait_for_a_locked_photo(pool: db.Pool) -> None:
    """The retry (job first) skips a photo row another statement holds: no deadlock."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, "originals/x")
    token = (await leases.claim(pool, photo_id, "1-0", "w")).token
    async with pool.acquire() as holder, holder.transaction():
        await holder.execute("SELECT 1 FROM photos WHERE id = $1 FOR UPDATE", photo_id)
        retry = failures.record_retry(pool, photo_id, token, "timeout", "slow", 10)
        assert await asyncio.wait_for(retry, 5)
    assert await pool.fetchval("SELECT state FROM photo_jobs WHERE photo_id = $1", photo_id) == (
        "pending"
    )


def _index_scans(node: dict[str, Any]) -> set[str]:
    """Names of the indexes a JSON plan scans, anywhere in the tree."""
    names = {node["Index Name"]} if "Index Name" in node else set()
    for child in node.get("Plans", []):
        names |= _index_scans(child)
    return names


def _node_types(node: dict[str, Any]) -> set[str]:
    types = {node["Node Type"]}
    for child in node.get("Plans", []):
        types |= _node_types(child)
    return types


async def _plan(pool: db.Pool, sql: str, *args: Any) -> dict[str, Any]:
    raw = await pool.fetchval("EXPLAIN (FORMAT JSON) " + sql, *args)
    plan: dict[str, Any] = json.loads(raw)[0]["Plan"]
    return plan


async def test_page_query_scans_the_sweep_index(pool: db.Pool) -> None:
    """With 20,000 unfinished and 20,000 finished photos analysed, a sweep page (first or
    mid-backlog) is an index scan on photos_sweep_idx with no sort, and the lookup of
    deleted entries uses photo_jobs_stream_entry_idx."""
    await pool.execute(
        """
        INSERT INTO photos (id, original_key, processing_state, last_activity_at)
        SELECT gen_random_uuid(), 'originals/' || i,
               CASE WHEN i % 2 = 0 THEN 'processed' ELSE 'uploaded' END,
               now() - interval '1 hour' - i * interval '1 ms'
        FROM generate_series(1, 40000) i;
        INSERT INTO photo_jobs (photo_id, state, stream_entry)
        SELECT id, 'pending', (row_number() OVER ()) || '-0' FROM photos;
        ANALYZE photos; ANALYZE photo_jobs;
        """
    )
    before = await pool.fetchval("SELECT now() - interval '5 minutes'")
    middle = await pool.fetchrow(
        "SELECT last_activity_at, id FROM photos WHERE processing_state = 'uploaded'"
        " ORDER BY last_activity_at, id OFFSET 10000 LIMIT 1"
    )
    for after in (db.FIRST_PAGE, (middle["last_activity_at"], middle["id"])):
        plan = await _plan(pool, db.STALE_SQL, before, sweeper.BATCH, *after)
        assert "photos_sweep_idx" in _index_scans(plan), plan
        assert "Sort" not in _node_types(plan) and "Seq Scan" not in _node_types(plan), plan
        assert len(await db.stale_photos(pool, before, sweeper.BATCH, after)) == sweeper.BATCH
    plan = await _plan(pool, db.ENTRIES_SQL, ["17-0", "42-0"])
    assert "photo_jobs_stream_entry_idx" in _index_scans(plan), plan


async def test_migrate_brings_an_existing_database_to_the_keyset(
    pool: db.Pool, database_url: str
) -> None:
    """A database from before last_activity_at, with rows: migrate (twice) backfills each
    photo's last activity from photo and job, and leaves the column NOT NULL and indexed."""
    await pool.execute(
        """
        ALTER TABLE photos DROP COLUMN last_activity_at;
        DROP INDEX photo_jobs_stream_entry_idx;
        DROP TABLE darkroom_schema;
        CREATE INDEX photos_unfinished_idx
            ON photos (updated_at) WHERE processing_state IN ('uploaded', 'processing');
        """
    )
    job_later, alone = uuid.uuid4(), uuid.uuid4()
    for photo_id, hours in ((job_later, 3), (alone, 5)):
        await pool.execute(
            "INSERT INTO photos (id, original_key, updated_at)"
            " VALUES ($1, 'k', now() - make_interval(hours => $2))",
            photo_id,
            hours,
        )
    await pool.execute(
        "INSERT INTO photo_jobs (photo_id, stream_entry, updated_at)"
        " VALUES ($1, '1-0', now() - interval '1 hour')",
        job_later,
    )
    await db.migrate(database_url)
    await db.migrate(database_url)
    await pool.expire_connections()
    ages = {
        row["id"]: row["age"]
        for row in await pool.fetch(
            "SELECT id, round(extract(epoch FROM now() - last_activity_at) / 3600) AS age"
            " FROM photos"
        )
    }
    assert ages == {job_later: 1, alone: 5}
    indexes = {row["indexname"] for row in await pool.fetch("SELECT indexname FROM pg_indexes")}
    assert {"photos_sweep_idx", "photo_jobs_stream_entry_idx"} <= indexes
    assert "photos_unfinished_idx" not in indexes
    with pytest.raises(asyncpg.NotNullViolationError):
        await pool.execute("INSERT INTO photos (id, original_key, last_activity_at)"
                           " VALUES (gen_random_uuid(), 'k', NULL)")  # fmt: skip
    fresh = uuid.uuid4()
    await db.insert_photo(pool, fresh, "k")
    assert await moved(pool, fresh)
