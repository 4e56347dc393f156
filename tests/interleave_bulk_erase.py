"""`darkroom bulk erase` as a step of the interleaving test (tests/test_interleavings.py):
an operator erases one tenant's photos by query (the originals too, or not) between any
two calls of the workers' jobs, sometimes stopped part-way and continued by a later run of
the same selection. Promises: each photo is erased at most once per action (BulkRules'
invariant counts these acts with the other verbs'), and an erased photo keeps the erase's
promises (EraseRules: never published after the commit, none of its objects left)."""

from __future__ import annotations

import io
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from darkroom.operate import bulk, erasing
from darkroom.operate.progress import Progress
from darkroom.store import audit, selection
from darkroom.store.db import Connection
from darkroom.store.selection import Selection

TENANT_SQL = "SELECT tenant FROM photos WHERE id = $1"


class BulkEraseRules:
    """Mixed into the machine before BulkRules and EraseRules (it uses their `bulk_acts`
    and `erased`; the machine supplies rig, op, storage, photos, _do)."""

    rig: Any
    op: Any
    storage: Any
    photos: list[uuid.UUID]
    bulk_acts: Counter[tuple[uuid.UUID, uuid.UUID]]
    erased: dict[uuid.UUID, bool]

    def _do(self, coro: Any) -> Any:
        raise NotImplementedError

    @precondition(lambda self: self.photos)
    @rule(pick=st.integers(0, 3), original=st.booleans(), limit=st.integers(1, 4))
    def bulk_erase(self, pick: int, original: bool, limit: int) -> None:
        """`darkroom bulk erase --tenant T [--original]` over the tenant of photo `pick`,
        stopped after `limit` photos (a rerun of the same selection continues it)."""
        photo_id = self.photos[pick % len(self.photos)]
        tenant = self._do(self.rig.pool.fetchval(TENANT_SQL, photo_id))
        done = self._do(self._bulk_erase(tenant, original, limit))
        note(f"bulk erase tenant={tenant!r}{' --original' if original else ''} "
             f"limit={limit}: {done}")  # fmt: skip

    async def _bulk_erase(self, tenant: str, original: bool, limit: int) -> dict[str, int]:
        plan = bulk.plan_of("erase", Selection(tenant=tenant), None, None, original)
        assert isinstance(plan, bulk.Plan)
        action = audit.Action(operator="interleave", via="cli", action=bulk.action_name("erase"))
        run = bulk.Run(action, plan, limit=limit)
        total, _ = await bulk.begin(self.rig.pool, run)
        run.plan = _Counted(plan.verb, plan.where, original=original, rules=self,
                            action_id=run.action.action_id)  # fmt: skip
        run.deliver = erasing.Deleter(self.rig.pool, self.storage, original, run.tally,
                                      lambda _: None)  # fmt: skip
        progress = Progress(total, "erased", io.StringIO())
        complete = await bulk.execute(self.rig.pool, self.op, run, progress)
        counts = await bulk.finish(self.rig.pool, run, complete)
        return {**counts, **run.tally}


@dataclass(frozen=True)
class _Counted(bulk.Plan):
    """The erase plan whose act is counted per (action, photo) and marks the photo erased
    (with its original, or not) for EraseRules' promises."""

    rules: Any = None
    action_id: uuid.UUID = selection.ZERO

    def act(self) -> selection.Act:
        real, rules = super().act(), self.rules

        async def counted(conn: Connection, photo_id: uuid.UUID) -> selection.ItemState:
            outcome = await real(conn, photo_id)
            if outcome != "skipped":
                rules.bulk_acts[(self.action_id, photo_id)] += 1
                rules.erased[photo_id] = rules.erased.get(photo_id, False) or self.original
            return outcome

        return counted
