"""A timed pause that runs out ends once: whichever replica's watch reads it first deletes
its row, and that transaction writes its one `darkroom.queue.resumed` event (`expired`) and
its one audit row (`resume` via `timer`), however many replicas look at once; a pause or a
resume made after it finds it ended and ends it again for no one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from darkroom.pausing import PauseWatch
from darkroom.store import audit, db, pauses

REPLICAS = 12
RESUMED_SQL = "SELECT data FROM photo_events WHERE type = 'darkroom.queue.resumed' ORDER BY id"
TRAIL_SQL = "SELECT operator, via, action, selection, reason FROM operator_actions ORDER BY id"


def alice(verb: str) -> audit.Action:
    return audit.Action(operator="alice", via="cli", action=verb, reason="quota")


async def ran_out(pool: db.Pool, scope: tuple[str | None, str | None]) -> None:
    """A pause of `scope` that ran out a moment ago (0.05 s after its commit)."""
    await pauses.pause(pool, alice("pause"), scope, 0.05)
    await asyncio.sleep(0.1)


async def resumed(pool: db.Pool) -> list[dict[str, Any]]:
    return [json.loads(r["data"]) for r in await pool.fetch(RESUMED_SQL)]


async def test_many_replicas_watching_end_a_timed_pause_once(database_url: str) -> None:
    """Twelve watches, each on its own pool, look at once at two pauses past their time
    (the second's pause ended the first): one `resumed` event and one `timer` audit row
    each, and no watch's copy holds either."""
    pools = [await db.connect(database_url, 2) for _ in range(REPLICAS)]
    heard: list[Any] = []
    try:
        await ran_out(pools[0], ("bulk", None))
        await ran_out(pools[0], (None, "acme"))
        watches = [PauseWatch(pool, heard.append) for pool in pools]
        await asyncio.gather(*(w.look() for w in watches))
        await asyncio.gather(*(w.look() for w in watches))
        events = await resumed(pools[0])
        trail = [dict(r) for r in await pools[0].fetch(TRAIL_SQL)]
        left = await pools[0].fetchval("SELECT count(*) FROM queue_pauses")
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))
    assert len(events) == 2
    assert {(e["lane"], e["tenant"]) for e in events} == {(None, "acme"), ("bulk", None)}
    assert all(e["expired"] and e["resumed_by"] is None for e in events)
    assert all(e["operator"] == "alice" and e["until"] for e in events)
    timers = [t for t in trail if t["via"] == "timer"]
    assert len(timers) == 2 and all(t["action"] == "resume" for t in timers)
    assert {t["operator"] for t in timers} == {"alice"}
    assert {json.loads(t["selection"])["lane"] for t in timers} == {"bulk", None}
    assert left == 0 and heard == [], "a watch saw a pause that had run out"


async def test_a_pause_or_resume_after_the_time_ends_it_once_too(database_url: str) -> None:
    """No watch runs: the next resume ends the pause that ran out (its `expired` event) and
    reports nothing resumed by its operator; pausing the scope again after another one ran
    out ends that one first. One `resumed` event per pause."""
    pool = await db.connect(database_url, 2)
    try:
        await ran_out(pool, ("bulk", None))
        assert await pauses.resume(pool, alice("resume"), (None, None)) == []
        await ran_out(pool, (None, "acme"))
        await pauses.pause(pool, alice("pause"), (None, "acme"), None)
        assert [p["tenant"] for p in await pauses.active(pool)] == ["acme"]
        ended = await pauses.resume(pool, alice("resume"), (None, "acme"))
        events = await resumed(pool)
    finally:
        await pool.close()
    assert [(e["lane"], e["tenant"], e["expired"]) for e in events] == [
        ("bulk", None, True), (None, "acme", True), (None, "acme", False)]  # fmt: skip
    assert len(ended) == 1 and events[2]["resumed_by"] == "alice"


async def test_the_expiry_races_an_explicit_resume_and_one_of_them_ends_it(
    database_url: str,
) -> None:
    """A resume and the watches of several replicas at the same moment, on a pause that
    ran out, and on one still in force: each pause ends exactly once."""
    pools = [await db.connect(database_url, 2) for _ in range(6)]
    try:
        await pauses.pause(pools[0], alice("pause"), ("interactive", None), None)
        await ran_out(pools[0], ("bulk", None))
        looks = [PauseWatch(pool, lambda _: None).look() for pool in pools[1:]]
        resume = pauses.resume(pools[0], alice("resume"), (None, None))
        await asyncio.gather(resume, *looks)
        events = await resumed(pools[0])
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))
    assert len(events) == 2
    assert {(e["lane"], e["expired"]) for e in events} == {("bulk", True), ("interactive", False)}
