"""The interleaving test's bulk-action rules (a mixin of tests/test_interleavings.py): a
small `darkroom bulk retry|rerender` over one tenant's photos runs between the workers'
steps, sometimes stopped part-way and continued by a later run of the same selection;
each photo is acted on at most once per action, and the drain still ends every photo in
one final outcome (the machine's own promises, with these requests in its ledger)."""

from __future__ import annotations

import io
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from darkroom.operate import bulk
from darkroom.operate.progress import Progress
from darkroom.store import audit, selection
from darkroom.store.db import Connection
from darkroom.store.selection import Selection

PHOTO_SQL = "SELECT tenant, processing_state FROM photos WHERE id = $1"
VERB_OF = {"processing_failed": "retry", "processed": "rerender"}
ACTED_SQL = """
SELECT action_id, count(*)::int AS n FROM bulk_action_items
WHERE state IN ('acted', 'sent') GROUP BY 1
"""


class BulkRules:
    """Mixed into the Interleavings machine (it supplies rig, op, ledger, photos, _do)."""

    rig: Any
    op: Any
    ledger: Any
    photos: list[uuid.UUID]

    def _do(self, coro: Any) -> Any:
        raise NotImplementedError

    @initialize()
    def bulk_trail_empty(self) -> None:
        """The trail outlives a schedule's photos (ids 1..4 come back): start it empty."""
        self.bulk_acts: Counter[tuple[uuid.UUID, uuid.UUID]] = Counter()
        self._do(self._empty_trail())

    async def _empty_trail(self) -> None:
        await self.rig.pool.execute("DELETE FROM bulk_action_items")
        await self.rig.pool.execute("DELETE FROM operator_actions")

    @precondition(lambda self: self.photos)
    @rule(verb=st.sampled_from(["retry", "rerender"]), pick=st.integers(0, 3),
          limit=st.integers(1, 4))  # fmt: skip
    def bulk_action(self, verb: str, pick: int, limit: int) -> None:
        """`darkroom bulk VERB --tenant T` over the tenant of photo `pick` (the verb its
        state takes, once it is final), stopped after `limit` photos (a rerun of the same
        selection continues the same action)."""
        photo_id = self.photos[pick % len(self.photos)]
        row = self._do(self.rig.pool.fetchrow(PHOTO_SQL, photo_id))
        verb = VERB_OF.get(row["processing_state"], verb)
        done = self._do(self._bulk(verb, row["tenant"], limit))
        note(f"bulk {verb} tenant={row['tenant']!r} limit={limit}: {done}")

    async def _bulk(self, verb: str, tenant: str, limit: int) -> dict[str, int]:
        plan = bulk.plan_of(verb, Selection(tenant=tenant), None, None)
        assert isinstance(plan, bulk.Plan)
        action = audit.Action(operator="interleave", via="cli", action=bulk.action_name(verb))
        run = bulk.Run(action, plan, limit=limit)
        total, _ = await bulk.begin(self.rig.pool, run)
        run.plan = _Counted(plan.verb, plan.where, plan.to_lane, plan.to_tenant,
                            acts=self.bulk_acts, ledger=self.ledger,
                            action_id=run.action.action_id)  # fmt: skip
        complete = await bulk.execute(
            self.rig.pool, self.op, run, Progress(total, verb, io.StringIO())
        )
        return await bulk.finish(self.rig.pool, run, complete)

    @invariant()
    def each_photo_acted_on_at_most_once_per_action(self) -> None:
        """No (action, photo) was acted on twice, and the items say what was done."""
        acts = getattr(self, "bulk_acts", None)
        if acts is None:  # before the trail was emptied
            return
        twice = [key for key, n in acts.items() if n > 1]
        assert not twice, f"acted on more than once: {twice}"
        rows = self._do(self.rig.pool.fetch(ACTED_SQL))
        per_action = Counter(action_id for action_id, _ in acts)
        assert {r["action_id"]: r["n"] for r in rows} == dict(per_action)


@dataclass(frozen=True)
class _Counted(bulk.Plan):
    """The plan whose act is counted per (action, photo), and enters the ledger as a
    request when it acts."""

    acts: Counter[tuple[uuid.UUID, uuid.UUID]] = field(default_factory=Counter)
    ledger: Any = None
    action_id: uuid.UUID = selection.ZERO

    def act(self) -> selection.Act:
        real = super().act()

        async def counted(conn: Connection, photo_id: uuid.UUID) -> selection.ItemState:
            requested = self.ledger.now()
            outcome = await real(conn, photo_id)
            if outcome != "skipped":
                self.acts[(self.action_id, photo_id)] += 1
                self.ledger.requested[photo_id] = requested
            return outcome

        return counted
