"""Photo events: the outbox rows the outcome statements write, the relay to the events
stream (CloudEvents, at least once, in order per photo), retention, against the real servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
import redis.asyncio
from prometheus_client import REGISTRY

from darkroom.duty import Duty
from darkroom.errors import DatabaseUnavailableError
from darkroom.operate import events as events_command
from darkroom.operate.web import live
from darkroom.queue.eventstream import EventStream
from darkroom.relay import IDLE_PASS_S, PASS_GAP_S, Relay
from darkroom.store import db, duties, failures, leases, outbox, publishing
from tests.conftest import PHOTOS, REDIS_URL, Env

FACTS = {"width": 40, "height": 30, "format": "jpeg", "bytes": 99, "camera_make": "Fuji",
         "thumbhash": "3OcRJYB4d3h/iIeHeEh3eIhw+j2w", "dominant_color": "#336699"}  # fmt: skip
RENDITIONS = [{"name": "thumb", "key": "renditions/x/thumb-1.webp", "format": "webp",
               "width": 32, "height": 24, "bytes": 120}]  # fmt: skip
SOURCE = "darkroom://test"
LEASE_S = 1.0


@dataclass
class Outbox:
    url: str
    pool: db.Pool
    redis: Any
    stream: EventStream

    def relay(self) -> Relay:
        """A relay of its own process (its own holder of the relay's duty)."""
        duty = Duty(duties.RELAY, self.pool, f"relay-{uuid.uuid4().hex[:6]}", LEASE_S)
        return Relay(duty, self.url, self.stream, SOURCE, keep_days=7)

    async def batch(self, relay: Relay, conn: Any = None) -> list[str]:
        """One batch as the duty's holder (a running relay holds it throughout), marked as
        the running relay's next pass marks it."""
        async with relay.duty.hold() as tenure:
            assert tenure is not None
            sent = await relay.relay_batch(conn or self.pool, tenure)
            assert await relay.mark_sent(conn or self.pool, tenure)
            return sent
        raise AssertionError("the duty was lost")

    async def entries(self) -> list[dict[str, Any]]:
        rows = await self.redis.xrange(self.stream.key)
        return [json.loads(fields["event"]) for _, fields in rows]

    async def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in await self.pool.fetch("SELECT * FROM photo_events ORDER BY id")]


@pytest.fixture
async def box(database_url: str) -> AsyncIterator[Outbox]:
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    stream = EventStream(client, f"{{e{uuid.uuid4().hex[:10]}}}:events", 1000)
    pool = await db.connect(database_url, 4)
    yield Outbox(database_url, pool, client, stream)
    await client.delete(stream.key)
    await client.aclose()
    await pool.close()


async def claimed(pool: db.Pool, entry: str = "1-0") -> tuple[uuid.UUID, int]:
    """A new photo claimed through `entry`, and the claim's fencing token."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
    claim = await leases.claim(pool, photo_id, entry, "w1")
    assert claim.outcome == "claimed"
    return photo_id, claim.token


async def published(pool: db.Pool) -> uuid.UUID:
    photo_id, token = await claimed(pool)
    done = await publishing.publish(pool, photo_id, FACTS, json.dumps(RENDITIONS), (token, "1-0"))
    assert (done.status, done.replaced) == ("published", [])
    return photo_id


async def rerender_claimed(
    pool: db.Pool, photo_id: uuid.UUID, entry: str = "2-0"
) -> tuple[int, str]:
    """A re-render requested and claimed through `entry` (each request has an entry of its
    own: a claim through an entry whose run is done starts nothing): its lease."""
    assert await publishing.request_rerender(pool, [photo_id], None) == [photo_id]
    claim = await leases.claim(pool, photo_id, entry, "w1")
    assert claim.outcome == "claimed"
    return claim.token, entry


async def until(check: Callable[[], bool], timeout_s: float = 5) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await anyio.sleep(0.01)
    raise AssertionError("timed out")


async def until_async(read: Callable[[], Awaitable[list[Any]]], count: int) -> None:
    for _ in range(500):
        if len(await read()) >= count:
            return
        await anyio.sleep(0.01)
    raise AssertionError("timed out")


ENVELOPE = {"specversion", "id", "source", "type", "subject", "time", "datacontenttype", "data"}


async def test_every_terminal_outcome_is_one_cloudevent_with_the_photo_row(box: Outbox) -> None:
    """Published, rerendered, failed, rerender_failed: one event each, CloudEvents fields."""
    first = await published(box.pool)
    lease = await rerender_claimed(box.pool, first)
    await publishing.publish(box.pool, first, FACTS, json.dumps(RENDITIONS), lease)
    failed, token = await claimed(box.pool)
    recorded = await failures.record_failure(box.pool, failed, token, "1-0", "corrupt_image", "bad")
    assert recorded == "failed"
    token, _ = await rerender_claimed(box.pool, first, "3-0")
    rerender = await failures.record_rerender_failure(box.pool, first, token, "timeout", "slow")
    assert rerender == "answered"
    await box.batch(box.relay())
    events = await box.entries()
    assert [e["type"].rsplit(".", 1)[1] for e in events] == [
        "published", "rerendered", "failed", "rerender_failed"]  # fmt: skip
    assert all(set(e) == ENVELOPE and e["specversion"] == "1.0" for e in events)
    assert len({e["id"] for e in events}) == 4 and events[0]["source"] == SOURCE
    assert events[0]["subject"] == str(first) and events[0]["time"].endswith("Z")
    data = events[0]["data"]
    assert data["renditions"] == RENDITIONS and data["facts"]["camera_make"] == "Fuji"
    assert data["facts"]["width"] == 40 and data["thumbhash"] == FACTS["thumbhash"]
    assert data["dominant_color"] == "#336699" and data["lane"] == "interactive"
    assert data["tenant"] == "" and "error_code" not in data
    assert events[2]["data"]["error_code"] == "corrupt_image"
    assert events[3]["data"]["error_code"] == "timeout" and events[3]["data"]["renditions"]


async def test_a_rolled_back_publish_leaves_no_event_and_no_notification(box: Outbox) -> None:
    """Never before the commit: a publish whose transaction rolls back writes nothing."""
    photo_id, token = await claimed(box.pool)
    heard: list[str] = []
    async with outbox.listening(box.url, lambda payload: heard.append(str(payload))) as listener:
        async with box.pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            row = await conn.fetchrow(publishing.PUBLISH_SQL, photo_id, 1, 1, "jpeg", 1, "[]",
                                      *[None] * len(publishing.FACT_COLUMNS), *[None] * 5,
                                      token, "1-0", None, None, False)  # fmt: skip
            assert row is not None and row["status"] == "published"
            assert await box.rows() == []  # not visible before the commit
            await tx.rollback()
        await anyio.sleep(0.3)
        assert not listener.is_closed()
    assert heard == [] and await box.rows() == []
    assert await box.batch(box.relay()) == []


async def test_an_outcome_that_changes_nothing_writes_no_event(box: Outbox) -> None:
    """A duplicate publish or a stale failure changes no state, so it reports none."""
    photo_id, token = await claimed(box.pool)
    lease = (token, "1-0")
    first = await publishing.publish(box.pool, photo_id, FACTS, json.dumps(RENDITIONS), lease)
    assert first.status == "published"
    assert (await publishing.publish(box.pool, photo_id, FACTS, "[]", lease)).status == "already"
    stale = await failures.record_failure(box.pool, photo_id, token, "1-0", "timeout", "x")
    assert stale == "finished"
    assert [r["type"] for r in await box.rows()] == ["darkroom.photo.published"]


async def test_a_relay_killed_before_marking_sends_again_with_the_same_id(box: Outbox) -> None:
    """At least once: XADDed but not marked (a kill in between) is sent again, same `id`."""
    await published(box.pool)
    pending = await outbox.unpublished(box.pool, 10)
    await box.stream.append([json.dumps(outbox.envelope(e, SOURCE)) for e in pending])
    await box.batch(box.relay())
    ids = [e["id"] for e in await box.entries()]
    assert len(ids) == 2 and ids[0] == ids[1] == str(pending[0].event_id)
    assert await box.batch(box.relay()) == []  # marked now: not sent a third time


async def test_the_relay_wakes_on_commit_and_keeps_each_photos_order(box: Outbox) -> None:
    """A running relay publishes on the commit, not at its next idle pass, in order per photo; a
    second relay waits for the duty instead of publishing too."""
    one, other = box.relay(), box.relay()
    relayed = REGISTRY.get_sample_value("darkroom_events_relayed_total") or 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(one.run)
        await until(lambda: one.holding)
        assert REGISTRY.get_sample_value("darkroom_events_relay") == 1
        tg.start_soon(other.run)
        photo_id = await published(box.pool)
        committed = time.monotonic()
        lease = await rerender_claimed(box.pool, photo_id)
        await publishing.publish(box.pool, photo_id, FACTS, json.dumps(RENDITIONS), lease)
        await until_async(lambda: box.entries(), 2)
        # woken by the commit's NOTIFY: an idle pass would come only after IDLE_PASS_S (30 s)
        assert time.monotonic() - committed < IDLE_PASS_S / 3
        assert not other.holding
        tg.cancel_scope.cancel()
    types = [e["type"] for e in await box.entries()]
    assert types == ["darkroom.photo.published", "darkroom.photo.rerendered"]
    assert REGISTRY.get_sample_value("darkroom_events_relayed_total") == relayed + 2


async def test_after_a_busy_stretch_the_relay_still_wakes_on_the_next_commit(box: Outbox) -> None:
    """A relay passing back to back stops listening; once a pass finds nothing it listens
    again, and an event committed then still leaves on its commit, every one marked once."""
    relay = box.relay()
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        await until(lambda: relay.holding)
        for _ in range(12):  # a pass every PASS_GAP_S finds some of them
            await published(box.pool)
            await anyio.sleep(PASS_GAP_S / 2)
        assert not relay.listening
        await until(lambda: relay.listening)
        await anyio.sleep(0.2)
        committed = time.monotonic()
        await published(box.pool)
        await until_async(box.entries, 13)
        assert time.monotonic() - committed < IDLE_PASS_S / 3
        await relay.flush()
        tg.cancel_scope.cancel()
    assert len(await box.entries()) == 13
    assert all(r["published_at"] is not None for r in await box.rows())


async def test_retention_deletes_old_published_events_and_keeps_unpublished(box: Outbox) -> None:
    """Past DARKROOM_EVENTS_KEEP_DAYS a published event goes; an unpublished one stays."""
    for _ in range(3):
        await published(box.pool)
    await box.pool.execute("UPDATE photo_events SET created_at = now() - interval '8 days'")
    await box.pool.execute("UPDATE photo_events SET published_at = now() WHERE id < 3")
    assert await outbox.prune(box.pool, 7 * 86400, 1) == 1
    assert await outbox.prune(box.pool, 7 * 86400, 10) == 1
    assert [r["id"] for r in await box.rows()] == [3]


def publish_photos(url: str, count: int) -> list[uuid.UUID]:
    async def go() -> list[uuid.UUID]:
        pool = await db.connect(url, 2)
        try:
            return [await published(pool) for _ in range(count)]
        finally:
            await pool.close()

    return asyncio.run(go())


def test_events_command_replays_in_order_since_an_id_or_a_time(file_env: Env) -> None:
    """`darkroom events` replays from PostgreSQL; --since takes an event id or a time."""
    photos = publish_photos(file_env.database_url, 3)
    file_env.query("UPDATE photo_events SET created_at = now() - interval '1 hour' WHERE id = 1")
    every = [json.loads(x) for x in file_env.cli("events", "--json").stdout.splitlines()]
    assert [e["subject"] for e in every] == [str(p) for p in photos]
    after_first = file_env.cli("events", "--json", "--since", every[0]["id"]).stdout
    assert [json.loads(x)["id"] for x in after_first.splitlines()] == [e["id"] for e in every[1:]]
    half_hour_ago = (datetime.now(UTC) - timedelta(minutes=30)).isoformat()
    from_time = file_env.cli("events", "--since", half_hour_ago).stdout.splitlines()
    assert len(from_time) == 2 and str(photos[1]) in from_time[0]
    assert "darkroom.photo.published" in from_time[0]
    missing = file_env.cli("events", "--since", str(uuid.uuid4()), check=False)
    assert missing.returncode == 2 and "no event" in missing.stderr


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout lines as they come (a thread reads them)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    return lines


def test_events_follow_prints_what_commits_after_it_started(file_env: Env) -> None:
    """--follow prints the history, then each new event as it commits (LISTEN)."""
    first = publish_photos(file_env.database_url, 1)
    lines = lines_of(file_env.start("events", "--follow", "--json"))
    assert json.loads(lines.get(timeout=10))["subject"] == str(first[0])
    later = publish_photos(file_env.database_url, 2)
    assert [json.loads(lines.get(timeout=30))["subject"] for _ in later] == [str(p) for p in later]


def test_a_worker_relays_its_outcomes_before_it_exits(file_env: Env) -> None:
    """`run --drain`: a published and a failed photo are both on the events stream at exit,
    marked sent: the next worker to relay sends neither again."""
    bad = file_env.tmp / "notes.jpg"
    bad.write_text("not a picture")
    good_id, bad_id = file_env.ingest([PHOTOS / "Landscape_3.jpg", bad])
    file_env.cli("run", "--drain")
    rows = file_env.redis.xrange(file_env.vars["DARKROOM_EVENTS_STREAM"])
    events = {e["subject"]: e for e in (json.loads(f["event"]) for _, f in rows)}
    assert events[str(good_id)]["type"] == "darkroom.photo.published"
    assert events[str(good_id)]["data"]["renditions"][0]["key"].startswith("renditions/")
    assert events[str(bad_id)]["type"] == "darkroom.photo.failed"
    assert events[str(bad_id)]["data"]["error_code"] == "unsupported_format"
    assert events[str(good_id)]["source"] == "darkroom://darkroom" and len(rows) == 2
    [unmarked] = file_env.query("SELECT count(*) AS n FROM photo_events WHERE published_at IS NULL")
    assert unmarked["n"] == 0, "sent but left unmarked: the next worker sends them again"
    file_env.cli("run", "--drain")
    assert file_env.redis.xlen(file_env.vars["DARKROOM_EVENTS_STREAM"]) == 2


def test_since_is_an_event_id_or_a_time_in_utc_by_default() -> None:
    """--since takes a CloudEvents id or an ISO time (no zone: UTC); anything else is usage."""
    event_id = uuid.uuid4()
    assert events_command.parse_since(str(event_id)) == event_id
    assert events_command.parse_since("2026-12-01T09:00") == datetime(2026, 12, 1, 9, tzinfo=UTC)
    with pytest.raises(argparse.ArgumentTypeError):
        events_command.parse_since("yesterday")


def test_a_follower_looks_again_for_ids_skipped_by_commits_in_flight_for_a_while() -> None:
    """Ids skipped by a later one are gaps until seen or GAP_WAIT_S old; a huge hole is not."""
    cursor = events_command.Cursor()
    cursor.take([1, 2, 5], now_s=0)
    assert cursor.after == 5 and sorted(cursor.gaps) == [3, 4]
    cursor.take([3], now_s=1)
    assert sorted(cursor.gaps) == [4]
    cursor.take([6 + events_command.MAX_GAP], now_s=events_command.GAP_WAIT_S + 1)
    assert cursor.gaps == {}


def test_a_slow_live_page_gets_one_resync_instead_of_a_backlog() -> None:
    """A page's queue never grows past its bound: overflow becomes a single resync."""
    page = live.Subscriber()
    for n in range(live.QUEUE_SIZE + 3):
        page.offer(json.dumps({"id": n}))
    assert page.queue[0] == live.RESYNC and len(page.queue) == 3
    assert live.frame(live.RESYNC) == "event: resync\ndata: {}\n\n"
    assert live.frame('{"id": 1}') == 'event: photo\ndata: {"id": 1}\n\n'


async def test_a_batch_sent_before_postgresql_failed_is_marked_not_sent_again(
    box: Outbox,
) -> None:
    """Sent, then the mark failed (PostgreSQL went away): the next try marks it, no resend."""
    await published(box.pool)
    relay = box.relay()
    async with relay.duty.hold() as tenure:
        assert tenure is not None
        assert len(await relay.relay_batch(box.pool, tenure)) == 1
        async with outbox.listening(box.url, lambda payload: None) as conn:
            await conn.execute("SET default_transaction_read_only = on")
            with pytest.raises(DatabaseUnavailableError):
                await relay.relay_batch(conn, tenure)  # marks, then reads: refused whole
    assert await box.batch(relay) == []
    assert len(await box.entries()) == 1
    assert all(r["published_at"] is not None for r in await box.rows())


async def test_another_relay_takes_over_when_the_relaying_one_loses_its_connection(
    box: Outbox,
) -> None:
    """A relay whose connection is lost gives its duty up: a relay (the waiting one, or the
    first once reconnected) takes it within seconds and sends what committed meanwhile."""
    one, other = box.relay(), box.relay()
    async with anyio.create_task_group() as tg:
        tg.start_soon(one.run)
        await until(lambda: one.holding)
        tg.start_soon(other.run)
        await anyio.sleep(0.3)
        await box.pool.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"  # this test's database only
            " WHERE pid <> pg_backend_pid() AND datname = current_database()"
        )
        await anyio.sleep(0.3)  # the pool sees its other connections closed
        await published(box.pool)
        await until_async(box.entries, 1)
        assert other.holding or one.holding
        tg.cancel_scope.cancel()
    assert [e["type"] for e in await box.entries()] == ["darkroom.photo.published"]
