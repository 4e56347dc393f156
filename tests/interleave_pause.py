"""The interleaving test's pause and resume (a mixin of tests/test_interleavings.py's
machine): an operator pauses a lane, a tenant or everything, for good or for a moment that
runs out, and resumes, and a replica's watch ends the pauses that ran out, between any two
calls of the workers. A user would notice a paused scope's photo claimed after the pause
committed, a photo that never ends once everything is resumed (the drain checks it), and a
pause whose end the events stream reports twice or never."""

from __future__ import annotations

from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from darkroom.pausing import PauseWatch
from darkroom.store import audit, pauses

SCOPES = [(None, None), ("bulk", None), ("interactive", None), (None, "t1"), ("bulk", "t2")]


def operator(verb: str) -> audit.Action:
    """A new action per step: the audit rules want one ending per action id."""
    return audit.Action(operator="interleaver", via="cli", action=verb, reason="schedule")


# The attempts counted so far of each photo of a scope: only a claim counts one (its own
# holder's, work in progress, counts none), so a count that grew while the scope was paused
# is a claim the pause should have refused, and an attempt it burned.
ATTEMPTS_SQL = """
SELECT p.id, coalesce(j.attempt, 0) AS attempt
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE ($1::text IS NULL OR p.lane = $1) AND ($2::text IS NULL OR p.tenant = $2)
"""
Scope = tuple[str | None, str | None]
Counts = dict[Any, int]
QUEUE_EVENTS_SQL = """
SELECT type, data->>'lane' AS lane, data->>'tenant' AS tenant FROM photo_events
WHERE type LIKE 'darkroom.queue.%' ORDER BY id
"""
# A timed pause short enough to have run out by the next step.
MOMENT_S = 0.001


class PauseRules:
    """Mixed into the machine; uses its rig, _do and _quiesce."""

    rig: Any
    _do: Any
    _quiesce: Any

    def __init__(self) -> None:
        super().__init__()
        # Each paused scope's attempt counts as they stood once the pause committed (the
        # schedule runs one call at a time: no claim is half-way then).
        self.paused: dict[Scope, Counts] = {}
        self.rig.run(self.rig.pool.execute("DELETE FROM queue_pauses"))
        # Everything is resumed before the machine's drain: every photo must then end.
        drain = self._quiesce

        async def resumed_then_drained() -> None:
            await self._resume((None, None))
            await drain()

        self._quiesce = resumed_then_drained

    @rule(scope=st.sampled_from(SCOPES))
    def pause(self, scope: Scope) -> None:
        """The operator pauses a scope; nothing of it may be claimed from its commit on."""
        note(f"pause {scope}")
        self.paused[scope] = self._do(self._pause(scope))

    async def _pause(self, scope: Scope) -> Counts:
        await pauses.pause(self.rig.pool, operator("pause"), scope, None)
        return await self._attempts(scope)

    async def _attempts(self, scope: Scope) -> Counts:
        return {r["id"]: r["attempt"] for r in await self.rig.pool.fetch(ATTEMPTS_SQL, *scope)}

    @rule(scope=st.sampled_from(SCOPES))
    def pause_for_a_moment(self, scope: Scope) -> None:
        """`pause --for`, run out at once: it replaces the scope's pause, holds nothing from
        the next step on, and ends with one `resumed` event (by a watch, a pause or a
        resume, whichever comes first)."""
        note(f"pause {scope} for a moment")
        self.paused.pop(scope, None)
        self._do(pauses.pause(self.rig.pool, operator("pause"), scope, MOMENT_S))

    @rule()
    def watch(self) -> None:
        """A replica's watch reads the pauses, ending those that ran out."""
        note("a watch looks")
        self._do(PauseWatch(self.rig.pool, lambda _: None).look())

    @rule(scope=st.sampled_from(SCOPES))
    def resume(self, scope: Scope) -> None:
        note(f"resume {scope}")
        self._do(self._resume(scope))

    async def _resume(self, scope: Scope) -> None:
        await pauses.resume(self.rig.pool, operator("resume"), scope)
        for held in [s for s in self.paused if _inside(s, scope)]:
            del self.paused[held]

    @invariant()
    def nothing_paused_is_claimed(self) -> None:
        """No photo of a paused scope was claimed (an attempt counted) since it was paused."""
        for scope, before in self.paused.items():
            now = self._do(self._attempts(scope))
            for photo, n in now.items():  # moved into the scope since (a bulk move, a retry
                before.setdefault(photo, n)  # into bulk): its earlier attempts are no claims
            grew = {p: (before[p], n) for p, n in now.items() if n > before[p]}
            assert not grew, f"paused {scope}, yet claimed (attempts before, now): {grew}"

    @invariant()
    def every_pause_ends_once(self) -> None:
        """Per scope, the events stream alternates: a `resumed` only for a pause open
        (one `paused` or more: a pause again replaces it), and a scope is open exactly
        while its row is in queue_pauses (in force, or run out and not ended yet)."""
        events = self._do(self.rig.pool.fetch(QUEUE_EVENTS_SQL))
        rows = self._do(self.rig.pool.fetch("SELECT lane, tenant FROM queue_pauses"))
        open_: set[Scope] = set()
        for event in events:
            scope = (event["lane"], event["tenant"])
            if event["type"] == pauses.RESUMED:
                assert scope in open_, f"{scope} resumed twice, or before it was paused"
                open_.discard(scope)
            else:
                open_.add(scope)
        assert open_ == {(r["lane"], r["tenant"]) for r in rows}, "a pause ended unreported"


def _inside(held: Scope, scope: Scope) -> bool:
    """Does resuming `scope` end the pause of `held` (store/pauses.RESUME_SQL's rule)?"""
    return all(s is None or h == s for h, s in zip(held, scope, strict=True))
