"""Modern formats with a fallback: AVIF renditions beside the JPEG/WebP ones, deferred off an
interactive photo's first publish and added by a fenced upgrade in the bulk lane, with a
`darkroom.photo.upgraded` event; against the real servers."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import pyvips
import redis.asyncio

from darkroom import sweeper
from darkroom.image.pipeline import render
from darkroom.queue.streams import Streams
from darkroom.settings import Settings, parse_renditions, split
from darkroom.store import audit, db, duties, erasure, leases, publishing, upgrading
from darkroom.upgrades import specs_for
from tests.conftest import PHOTOS, REDIS_URL, Env

FACTS = {"width": 40, "height": 30, "format": "jpeg", "bytes": 99}
FAST = [{"name": "medium", "format": "jpeg", "type": "image/jpeg", "key": "renditions/x/m-1.jpg",
         "width": 40, "height": 30, "bytes": 120}]  # fmt: skip
AVIF = [{"name": "medium", "format": "avif", "type": "image/avif", "key": "renditions/x/m-2.avif",
         "width": 40, "height": 30, "bytes": 60}]  # fmt: skip
LIST = "thumb:320:webp,medium:512:jpeg,medium:512:avif"


def test_avif_is_deferred_unless_inline_or_alone() -> None:
    """AVIF (a heavy format) is deferred by default, `:inline` keeps it in the first render,
    `:defer` defers any format, and a list of deferred renditions only renders them at once;
    a rendition may be named `inline` or `defer` (the flags are options only)."""
    specs = parse_renditions("a:320:webp,b:512:avif,c:512:avif:inline,d:64:jpeg:defer:70")
    assert [s.deferred for s in specs] == [False, True, False, True]
    assert specs[3].quality == 70
    fast, deferred = split(specs)
    assert [s.name for s in fast] == ["a", "c"] and [s.name for s in deferred] == ["b", "d"]
    alone = parse_renditions("b:512:avif")
    assert alone[0].deferred and split(alone) == (list(alone), [])
    with pytest.raises(ValueError, match="defer and inline both set"):
        parse_renditions("a:320:webp:defer:inline")
    named = parse_renditions("inline:1024:avif,defer:320:webp")  # names, not flags
    assert [(s.name, s.deferred) for s in named] == [("inline", True), ("defer", False)]


def test_an_interactive_render_defers_a_bulk_one_renders_all_an_upgrade_the_rest() -> None:
    """Which renditions each delivery renders, and whether it leaves an upgrade."""
    settings = Settings(renditions=parse_renditions(LIST))
    names = lambda specs: [(s.name, s.format) for s in specs]  # noqa: E731
    fast, deferred = specs_for(settings, "interactive", upgrade=False)
    assert deferred and ("medium", "avif") not in names(fast)
    every, deferred = specs_for(settings, "bulk", upgrade=False)
    assert not deferred and len(every) == 3
    assert names(specs_for(settings, "bulk", upgrade=True)[0]) == [("medium", "avif")]


def test_an_avif_rendition_decodes_beside_its_jpeg_fallback() -> None:
    """The AVIF rendition is a real AV1 HEIF of the fallback's size, and smaller."""
    data = (PHOTOS / "Landscape_1.jpg").read_bytes()
    jpeg, avif = render(data, parse_renditions("m:512:jpeg,m:512:avif"), 10**8).renditions
    decoded = pyvips.Image.new_from_buffer(avif.data, "")
    assert decoded.get("vips-loader").startswith("heifload")
    assert decoded.get("heif-compression") == "av1"
    assert (decoded.width, decoded.height) == (jpeg.width, jpeg.height) == (avif.width, avif.height)
    assert decoded.avg() > 10 and len(avif.data) < len(jpeg.data)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    opened = await db.connect(database_url, 4)
    yield opened
    await opened.close()


async def published(pool: db.Pool) -> uuid.UUID:
    """A photo's first publish, which left its AVIF for an upgrade."""
    photo_id = uuid.uuid4()
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
    claim = await leases.claim(pool, photo_id, "1-0", "w1")
    done = await publishing.publish(
        pool, photo_id, FACTS, json.dumps(FAST), (claim.token, "1-0"), deferred=True
    )
    assert done.status == "published"
    return photo_id


async def upgrade_claimed(pool: db.Pool, photo_id: uuid.UUID, entry: str = "2-0") -> int:
    claim = await leases.claim(pool, photo_id, entry, "w2", lane="bulk")
    assert (claim.outcome, claim.upgrade) == ("claimed", True)
    return claim.token


async def row(pool: db.Pool, photo_id: uuid.UUID) -> dict[str, Any]:
    found = await pool.fetchrow("SELECT * FROM photos WHERE id = $1", photo_id)
    assert found is not None
    return dict(found)


async def events(pool: db.Pool, photo_id: uuid.UUID) -> list[str]:
    rows = await pool.fetch(
        "SELECT type FROM photo_events WHERE photo_id = $1 ORDER BY id", photo_id
    )
    return [r["type"].rsplit(".", 1)[1] for r in rows]


def formats(renditions: str) -> list[tuple[str, str]]:
    return [(r["name"], r["format"]) for r in json.loads(renditions)]


async def test_an_upgrade_adds_the_avif_beside_its_fallback_with_an_event(pool: db.Pool) -> None:
    """Published with its fast renditions and an upgrade requested; an interactive entry
    does not take the upgrade, a bulk one does, and its publish adds the AVIF to the
    manifest (the fallback kept), clears the request and writes `upgraded`."""
    photo_id = await published(pool)
    assert (await row(pool, photo_id))["upgrade_requested_at"] is not None
    duplicate = await leases.claim(pool, photo_id, "1-1", "w1", lane="interactive")
    assert duplicate.outcome == "already"
    token = await upgrade_claimed(pool, photo_id)
    done = await upgrading.publish_upgrade(pool, photo_id, json.dumps(AVIF), (token, "2-0"))
    assert (done.status, done.replaced, done.again) == ("upgraded", [], False)
    after = await row(pool, photo_id)
    assert formats(after["renditions"]) == [("medium", "jpeg"), ("medium", "avif")]
    assert after["upgrade_requested_at"] is None and after["processing_state"] == "processed"
    assert await events(pool, photo_id) == ["published", "upgraded"]
    sql = "SELECT data FROM photo_events WHERE photo_id = $1 AND type LIKE '%upgraded'"
    data = json.loads(await pool.fetchval(sql, photo_id))
    assert data["renditions"] == FAST + AVIF
    again = await upgrading.publish_upgrade(pool, photo_id, json.dumps(AVIF), (token, "2-0"))
    assert again.status == "already"  # its job is done: one upgrade, one event
    assert (await leases.claim(pool, photo_id, "3-0", "w2", lane="bulk")).outcome == "already"


async def test_an_upgrade_with_nothing_left_to_add_answers_the_request_without_an_event(
    pool: db.Pool,
) -> None:
    """The deferred list was emptied after the request (AVIF taken out of the settings): the
    upgrade's publish adds nothing, answers the request and writes no `upgraded` event."""
    photo_id = await published(pool)
    token = await upgrade_claimed(pool, photo_id)
    done = await upgrading.publish_upgrade(pool, photo_id, "[]", (token, "2-0"))
    assert done.status == "upgraded"
    after = await row(pool, photo_id)
    assert formats(after["renditions"]) == [("medium", "jpeg")]
    assert after["upgrade_requested_at"] is None
    assert await events(pool, photo_id) == ["published"]


async def test_an_upgrade_of_an_older_render_is_refused_after_a_rerender(pool: db.Pool) -> None:
    """A re-render claimed and published while the upgrade rendered wins: the stale upgrade
    (its token superseded, the newer render's upgrade active) adds nothing to the newer
    manifest and writes no event; the newer render's own upgrade then does."""
    photo_id = await published(pool)
    stale = await upgrade_claimed(pool, photo_id)
    assert await publishing.request_rerender(pool, [photo_id], None) == [photo_id]
    claim = await leases.claim(pool, photo_id, "3-0", "w3", lane="interactive")
    assert claim.outcome == "claimed" and not claim.upgrade
    newer = [{**FAST[0], "key": "renditions/x/m-3.jpg"}]
    done = await publishing.publish(pool, photo_id, FACTS, json.dumps(newer),
                                    (claim.token, "3-0"), deferred=True)  # fmt: skip
    assert done.status == "published"
    current = await upgrade_claimed(pool, photo_id, "4-0")  # the newer render's upgrade
    refused = await upgrading.publish_upgrade(pool, photo_id, json.dumps(AVIF), (stale, "2-0"))
    assert refused.status == "already"
    after = await row(pool, photo_id)
    assert json.loads(after["renditions"]) == newer and after["upgrade_requested_at"]
    assert await events(pool, photo_id) == ["published", "rerendered"]
    refused = await upgrading.record_upgrade_failure(pool, photo_id, stale, "timeout", "x")
    assert refused == "not_recorded"
    fresh = [{**AVIF[0], "key": "renditions/x/m-4.avif"}]
    done = await upgrading.publish_upgrade(pool, photo_id, json.dumps(fresh), (current, "4-0"))
    assert done.status == "upgraded"
    assert json.loads((await row(pool, photo_id))["renditions"]) == newer + fresh


async def test_an_upgrade_of_an_erased_photo_is_refused(pool: db.Pool) -> None:
    """An erase committed during the upgrade revokes its lease: `erased`, nothing added."""
    photo_id = await published(pool)
    token = await upgrade_claimed(pool, photo_id)
    action = audit.Action(operator="test", via="cli", action="erase", reason="test")
    await erasure.erase(pool, [photo_id], action)
    refused = await upgrading.publish_upgrade(pool, photo_id, json.dumps(AVIF), (token, "2-0"))
    assert refused.status == "erased"
    after = await row(pool, photo_id)
    assert after["processing_state"] == "erased" and after["renditions"] is None
    assert await events(pool, photo_id) == ["published", "erased"]


async def test_a_failed_upgrade_keeps_the_published_renditions(pool: db.Pool) -> None:
    """An upgrade that fails for good drops its request; the photo stays published."""
    photo_id = await published(pool)
    token = await upgrade_claimed(pool, photo_id)
    failed = await upgrading.record_upgrade_failure(pool, photo_id, token, "timeout", "slow")
    assert failed == "dropped"
    after = await row(pool, photo_id)
    assert after["upgrade_requested_at"] is None and formats(after["renditions"]) == [
        ("medium", "jpeg")]  # fmt: skip
    assert await events(pool, photo_id) == ["published"]


async def test_an_upgrade_failing_after_a_rerender_request_sends_the_photo_again(
    pool: db.Pool,
) -> None:
    """A re-render requested while an upgrade renders, then the upgrade fails for good: it
    is recorded as the upgrade's failure (no `rerender_failed` event for a re-render that
    never ran, the upgrade's request dropped), and the re-render request stays with the
    photo cleared for the feeder, to go through again (it was recorded as a failed
    re-render before)."""
    photo_id = await published(pool)
    token = await upgrade_claimed(pool, photo_id)
    assert await publishing.request_rerender(pool, [photo_id], None) == [photo_id]
    failed = await upgrading.record_upgrade_failure(pool, photo_id, token, "timeout", "slow")
    assert failed == "again"
    after = await row(pool, photo_id)
    assert after["upgrade_requested_at"] is None and after["rerender_requested_at"] is not None
    assert after["enqueued_at"] is None
    assert await events(pool, photo_id) == ["published"]


def test_a_worker_publishes_first_then_upgrades_through_the_bulk_lane(file_env: Env) -> None:
    """Through a real worker: the photo is published without its AVIF, then upgraded in
    the bulk lane: its manifest lists the AVIF beside the JPEG fallback of the same name,
    each with its MIME type, and its events are `published` then `upgraded`."""
    [photo_id] = file_env.ingest([PHOTOS / "Landscape_1.jpg"])
    file_env.cli("run", "--drain", DARKROOM_RENDITIONS=LIST)
    [found] = file_env.query("SELECT * FROM photos WHERE id = $1", photo_id)
    manifest = json.loads(found["renditions"])
    assert [(r["name"], r["format"], r["type"]) for r in manifest] == [
        ("medium", "jpeg", "image/jpeg"), ("thumb", "webp", "image/webp"),
        ("medium", "avif", "image/avif")]  # fmt: skip
    jpeg, avif = manifest[0], manifest[2]
    assert (jpeg["width"], jpeg["height"]) == (avif["width"], avif["height"])
    assert avif["bytes"] < jpeg["bytes"] and found["upgrade_requested_at"] is None
    rows = file_env.query(
        "SELECT type, data FROM photo_events WHERE photo_id = $1 ORDER BY id", photo_id
    )
    assert [r["type"] for r in rows] == ["darkroom.photo.published", "darkroom.photo.upgraded"]
    first = json.loads(rows[0]["data"])["renditions"]
    assert [(r["name"], r["format"]) for r in first] == [("medium", "jpeg"), ("thumb", "webp")]
    lanes = file_env.query("SELECT lane, outcome FROM photo_attempts WHERE photo_id = $1 "
                           "ORDER BY id", photo_id)  # fmt: skip
    assert [(r["lane"], r["outcome"]) for r in lanes] == [
        ("interactive", "published"), ("bulk", "published")]  # fmt: skip


async def test_a_former_sweeps_take_of_lost_upgrades_is_refused(pool: db.Pool) -> None:
    """The sweep's take of lost upgrades is fenced by its duty: a former holder's take
    answers refused (None) and moves no request, the current holder's takes the photo."""
    photo_id = await published(pool)
    old_token = await duties.acquire(pool, "sweep", "old", 30)
    assert old_token is not None
    await pool.execute("UPDATE darkroom_duties SET expires_at = now() WHERE name = 'sweep'")
    new_token = await duties.acquire(pool, "sweep", "new", 30)
    assert new_token is not None and new_token > old_token
    later = datetime.now(UTC) + timedelta(seconds=1)
    old, new = duties.Fence("sweep", "old", old_token), duties.Fence("sweep", "new", new_token)
    before = (await row(pool, photo_id))["upgrade_requested_at"]
    assert await upgrading.take_lost(pool, later, None, 0, old, 10) is None
    assert (await row(pool, photo_id))["upgrade_requested_at"] == before
    assert list(await upgrading.take_lost(pool, later, None, 0, new, 10) or {}) == [photo_id]


async def test_the_sweep_enqueues_an_upgrade_whose_entry_was_lost(pool: db.Pool) -> None:
    """A worker gone between its publish and the upgrade's XADD: once the bulk stream holds
    no entry older than the request, the sweep adds one (and not while one may wait)."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    tag = uuid.uuid4().hex[:10]
    streams = Streams(client, f"{{u{tag}}}:photos", "darkroom", "w1", f"{{u{tag}}}:dead")
    bulk = streams.for_lane("bulk")
    try:
        waiting = await bulk.enqueue({"photo_id": str(uuid.uuid4())})  # older than the request
        photo_id = await published(pool)
        assert photo_id not in await sweeper.sweep(pool, streams, 0.0)
        await client.xdel(bulk.stream, waiting)
        assert await sweeper.sweep(pool, streams, 0.0) == [photo_id]
        [(_, fields)] = await client.xrange(bulk.stream)
        assert str(photo_id) in list(fields)
        assert await sweeper.sweep(pool, streams, 0.0) == []  # its entry waits now
    finally:
        await client.delete(streams.stream, bulk.stream, streams.dead_stream)
        await client.aclose()
