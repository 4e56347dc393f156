"""The audit trail in the interleaving test (tests/test_interleavings.py): each operator
step runs inside `audited`, as the command would, its rows written through the same pool
the workers claim and publish through; after every step, every action in the trail has
exactly one ending (and a long one its `started`), whatever ran in between."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any

from hypothesis.stateful import invariant

from darkroom.operate.audit import audited
from darkroom.store.audit import Action
from tests.interleave import Rig

# The schedule's operator steps: the trail's action and whether the command writes
# `started` first (the long ones).
AUDITED = {"replay": ("dlq.replay", True), "retry": ("retry", False),
           "rerender": ("rerender", True), "gc": ("gc", True)}  # fmt: skip

ENDINGS_SQL = """
SELECT action_id, count(*) FILTER (WHERE outcome <> 'started') AS endings,
       count(*) FILTER (WHERE outcome = 'started') AS starts
FROM operator_actions GROUP BY action_id
"""


def counted(result: Any) -> int:
    """What a step's result says it touched: gc's tally, else one photo or none."""
    if isinstance(result, dict):
        return int(result.get("deleted", 0))
    return int(isinstance(result, str))


class AuditRules:
    """Mixed into the machine: `_audited` wraps an operator step, the invariant reads the
    trail back."""

    rig: Rig

    def __init__(self) -> None:
        super().__init__()
        self.rig.run(self.rig.pool.execute("DELETE FROM operator_actions"))
        self.audit_runs: dict[uuid.UUID, bool] = {}  # action id: long

    def _do(self, coro: Any) -> Any:
        raise NotImplementedError  # the machine's

    async def _audited(self, step: str, work: Awaitable[Any]) -> Any:
        verb, long = AUDITED[step]
        action = Action(operator="schedule", via="cli", action=verb)
        self.audit_runs[action.action_id] = long
        async with audited(self.rig.pool, action, long) as tally:
            result = await work
            tally.count = counted(result)
        return result

    @invariant()
    def every_action_ended_once(self) -> None:
        """`darkroom audit` shows each operator step the schedule ran with exactly one
        ending, and a long one with its `started`: no action missing, none ended twice."""
        rows = {r["action_id"]: r for r in self._do(self.rig.pool.fetch(ENDINGS_SQL))}
        assert set(self.audit_runs) <= set(rows), "an operator step left no row"
        for action_id, row in rows.items():
            assert row["endings"] == 1, f"action {action_id}: {row['endings']} endings"
            long = self.audit_runs.get(action_id)
            if long is not None:
                assert row["starts"] == int(long), f"action {action_id}: {row['starts']} starts"
