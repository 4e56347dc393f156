"""Which scopes are paused, as a worker last read them: pure matching over the active
pauses (store/pauses.py reads them from PostgreSQL, the truth). A scope is a lane, a tenant,
both, or neither (everything); None in either field means every one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pause:
    lane: str | None  # None: every lane
    tenant: str | None  # None: every tenant

    def covers(self, lane: str, tenant: str | None = None) -> bool:
        """Does it hold `lane`'s photos of `tenant` (None: the lane as a whole)?"""
        if self.lane not in (None, lane):
            return False
        return self.tenant is None or self.tenant == tenant


@dataclass(frozen=True)
class Paused:
    """The active pauses a worker acts on; empty: nothing is paused."""

    pauses: frozenset[Pause] = frozenset()

    @classmethod
    def of(cls, rows: Iterable[Mapping[str, Any]]) -> Paused:
        return cls(frozenset(Pause(row["lane"], row["tenant"]) for row in rows))

    def lane(self, lane: str) -> bool:
        """The whole lane is paused: its stream is neither read nor reclaimed."""
        return any(p.tenant is None and p.covers(lane) for p in self.pauses)

    def tenants(self, lane: str) -> frozenset[str]:
        """Tenants paused in `lane` (the feeder feeds none of them)."""
        return frozenset(
            p.tenant for p in self.pauses if p.tenant is not None and p.lane in (None, lane)
        )

    def covers(self, lane: str, tenant: str) -> bool:
        return any(p.covers(lane, tenant) for p in self.pauses)
