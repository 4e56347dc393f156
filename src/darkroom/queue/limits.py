"""Per-tenant rate limits as the feeder applies them: which rate a tenant has (its own, else
DARKROOM_TENANT_RATE), and which tenants wait for their bucket until when. Pure: the
feeder's clock and the bucket's answers (queue/buckets.py) come in as numbers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    """`per_s` photos a second (0: unlimited), at most `burst` at once after an idle spell."""

    per_s: float
    burst: int = 0  # 0: one second's worth, at least one photo
    interactive: bool = False

    @property
    def limited(self) -> bool:
        return self.per_s > 0

    @property
    def interval_ms(self) -> float:
        return 1000.0 / self.per_s

    @property
    def photos_at_once(self) -> int:
        return self.burst or max(1, math.ceil(self.per_s))


UNLIMITED = Rate(0.0)


class Throttle:
    """The rates in force and the tenants held back. A tenant is held until its bucket
    has room again; releasing it early costs one more bucket call, never a photo."""

    def __init__(self, default: Rate = UNLIMITED) -> None:
        self.default = default
        self.own: dict[str, Rate] = {}
        self._until: dict[str, float] = {}
        self._due: list[tuple[float, str]] = []  # may hold stale pairs: _until decides

    def rate_of(self, tenant: str) -> Rate:
        return self.own.get(tenant, self.default)

    def load(self, own: Mapping[str, Rate]) -> list[str]:
        """The tenants' own rates, as stored now; if they changed, every held tenant is
        released (returned), so a cleared or raised limit never keeps one waiting."""
        if dict(own) == self.own:
            return []
        self.own = dict(own)
        return self.release_all()

    def hold(self, tenant: str, until: float) -> None:
        self._until[tenant] = until
        heapq.heappush(self._due, (until, tenant))

    def held(self, tenant: str) -> bool:
        return tenant in self._until

    def __len__(self) -> int:
        return len(self._until)

    def due(self, now: float) -> list[str]:
        """The held tenants whose time has come; they are no longer held."""
        released = []
        while self._due and self._due[0][0] <= now:
            until, tenant = heapq.heappop(self._due)
            if self._until.get(tenant) == until:
                del self._until[tenant]
                released.append(tenant)
        return released

    def next_due(self) -> float | None:
        while self._due and self._until.get(self._due[0][1]) != self._due[0][0]:
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else None

    def release_all(self) -> list[str]:
        released, self._until, self._due = list(self._until), {}, []
        return released
