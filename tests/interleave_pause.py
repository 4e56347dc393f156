"""The interleaving test's pause and resume (a mixin of tests/test_interleavings.py's
machine): an operator pauses a lane, a tenant or everything, and resumes, between any two
calls of the workers. A user would notice a paused scope's photo claimed after the pause
committed, and a photo that never ends once everything is resumed (the drain checks it)."""

from __future__ import annotations

from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from darkroom.store import audit, pauses

SCOPES = [(None, None), ("bulk", None), ("interactive", None), (None, "t1"), ("bulk", "t2")]


def operator() -> audit.Action:
    """Each pause or resume its own action in the trail (one ending each)."""
    return audit.Action(operator="interleaver", via="cli", action="pause", reason="schedule")


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
        await pauses.pause(self.rig.pool, operator(), scope, None)
        return await self._attempts(scope)

    async def _attempts(self, scope: Scope) -> Counts:
        return {r["id"]: r["attempt"] for r in await self.rig.pool.fetch(ATTEMPTS_SQL, *scope)}

    @rule(scope=st.sampled_from(SCOPES))
    def resume(self, scope: Scope) -> None:
        note(f"resume {scope}")
        self._do(self._resume(scope))

    async def _resume(self, scope: Scope) -> None:
        await pauses.resume(self.rig.pool, operator(), scope)
        for held in [s for s in self.paused if _inside(s, scope)]:
            del self.paused[held]

    @invariant()
    def nothing_paused_is_claimed(self) -> None:
        """No photo of a paused scope was claimed (an attempt counted) since it was paused."""
        for scope, before in self.paused.items():
            now = self._do(self._attempts(scope))
            grew = {p: (before.get(p, 0), n) for p, n in now.items() if n > before.get(p, 0)}
            assert not grew, f"paused {scope}, yet claimed (attempts before, now): {grew}"


def _inside(held: Scope, scope: Scope) -> bool:
    """Does resuming `scope` end the pause of `held` (store/pauses.RESUME_SQL's rule)?"""
    return all(s is None or h == s for h, s in zip(held, scope, strict=True))
