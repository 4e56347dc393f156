"""The interleaving test's rate-limit rules (a mixin of the machine in
tests/test_interleavings.py): an operator sets and clears a tenant's limit mid-schedule,
and the harness feeds the bulk lane through the feeder's own fair, limited path. The
promises: a limit is honoured; a tenant without one is fed in full whatever the others'
(work conserving); a limit never loses a photo, and once limits clear one pass feeds
every photo waiting (and the drain finishes them all)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import msgspec
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from darkroom.feeder import Feeder
from darkroom.store import audit, limits
from tests.promises import Broken

TENANTS = ("t1", "t2")
PER_MINUTE = 1  # a limit of 1/m, burst 1: one photo a minute of the buckets' clock
MINUTE_MS = 60_000.0
# A feedable bulk photo not yet fed, by tenant (what a limit may keep waiting).
UNFED_SQL = """
SELECT tenant, count(*) AS n FROM photos
WHERE lane = 'bulk' AND enqueued_at IS NULL
  AND (processing_state IN ('uploaded', 'processing')
       OR (processing_state = 'processed' AND rerender_requested_at IS NOT NULL))
GROUP BY tenant
"""


class LimitRules:
    """Mixed into the machine, whose attributes these use (rig, settings, op, _do). The
    machine's own feeding (before every worker's read, and in the drain) becomes the
    feeder's fair, limited pass: the instance's `_feed` and `_quiesce` are set here, so
    the machine's class keeps its plain ones and the mixin is one line in its bases."""

    rig: Any
    settings: Any
    op: Any

    def __init__(self) -> None:
        super().__init__()
        self.bucket_ms = 1_000_000.0  # the buckets' clock: moved only by a_minute_passes
        self.minutes = 0
        self.limited: set[str] = set()
        self.fed_limited: Counter[str] = Counter()
        self.rig.run(self.rig.pool.execute("DELETE FROM tenant_limits"))
        self.rig.run(self._limit(TENANTS[0]))  # set before the schedule: its first photos
        self._drain = self._quiesce
        self._feed = self._feed_within_limits  # type: ignore[method-assign]
        self._quiesce = self._quiesce_unlimited  # type: ignore[method-assign]

    def _do(self, coro: Any) -> Any: ...
    async def _feeder_tenure(self) -> Any: ...
    async def _quiesce(self) -> None: ...

    @rule(tenant=st.sampled_from(TENANTS))
    def set_limit(self, tenant: str) -> None:
        note(f"limits set {tenant} {PER_MINUTE}/m")
        self._do(self._limit(tenant))

    async def _limit(self, tenant: str) -> None:
        limit = limits.Limit(tenant=tenant, per_s=PER_MINUTE / 60, burst=1, shown="1/m")
        await limits.set_limit(self.rig.pool, limit, _action("limits.set", tenant))
        self.limited.add(tenant)

    @rule(tenant=st.sampled_from(TENANTS))
    def clear_limit(self, tenant: str) -> None:
        note(f"limits clear {tenant}")
        self._do(limits.clear_limit(self.rig.pool, tenant, _action("limits.clear", tenant)))
        self.limited.discard(tenant)

    @rule()
    def a_minute_passes(self) -> None:
        """On the buckets' clock only: each limited tenant may start one more photo."""
        self.bucket_ms += MINUTE_MS
        self.minutes += 1

    async def _feed_within_limits(self) -> int:
        """The machine's feeding: a tenant without a limit is fed in full, whatever the
        other's (work conserving); what a limited one was fed is counted."""
        fed, unfed = await self._feed_limited()
        for tenant in self.limited:
            self.fed_limited[tenant] += fed[tenant]
        if waiting := [t for t in unfed if t not in self.limited]:
            raise Broken(f"tenants without a limit left unfed by the feeder: {waiting}")
        return sum(fed.values())

    async def _quiesce_unlimited(self) -> None:
        """The faults stop and the operator clears every limit: the drain (through the
        limited feeder) must then finish every photo: none stalls, none was lost."""
        await self.rig.pool.execute("DELETE FROM tenant_limits")
        self.limited.clear()
        await self._drain()

    @rule()
    def clear_every_limit_and_feed(self) -> None:
        """Once limits clear, one pass feeds every tenant's every photo: none stalls, none
        was lost while held."""
        note("limits clear (all), feed")
        self._do(self.rig.pool.execute("DELETE FROM tenant_limits"))
        self.limited.clear()
        _, unfed = self._do(self._feed_limited())
        if unfed:
            raise Broken(f"photos left unfed once every limit cleared: {dict(unfed)}")

    async def _feed_limited(self) -> tuple[Counter[str], Counter[str]]:
        """One feeder pass through its fair, limited path (a new feeder: its state is
        rebuilt from PostgreSQL, as on a takeover); photos fed and left, by tenant."""
        settings = msgspec.structs.replace(self.settings, bulk_ahead=1_000)
        feeder = Feeder(settings, self.rig.pool, self.op, anyio.Event(), "harness")
        feeder.buckets.now_ms = lambda: self.bucket_ms
        feeder._tenure = await self._feeder_tenure()
        await feeder.bulk.ensure_group()
        async with self.rig.pool.acquire() as conn:
            before = await _unfed(conn)
            await feeder.load_limits(conn)
            await feeder._scan_tenants(conn)
            await feeder._feed_bulk(conn)
            after = await _unfed(conn)
        return before - after, after

    @invariant()
    def limits_are_honoured(self) -> None:
        """Fed while limited: at most its burst plus one a minute of the buckets' clock."""
        if over := {t: n for t, n in self.fed_limited.items() if n > 1 + self.minutes}:
            raise Broken(f"limited tenants fed past 1 + {self.minutes} photos: {over}")


def _action(name: str, tenant: str) -> audit.Action:
    return audit.Action(operator="harness", via="cli", action=name, selection={"tenant": tenant})


async def _unfed(conn: Any) -> Counter[str]:
    return Counter({row["tenant"]: row["n"] for row in await conn.fetch(UNFED_SQL)})
