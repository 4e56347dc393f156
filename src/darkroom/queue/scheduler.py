"""Which bulk photo next: deficit round robin over the backlogged tenants, charged by cost.

Pure (no I/O, no clock). The feeder loads each tenant's oldest photos on request (`Refill`),
reports the tenants' in-flight counts (`settle`) and holds back a tenant over its rate
(`hold`, `give_back`, `release`); every decision is taken here.
See docs/fairness.md for the design and the alternatives rejected.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

# What a photo of unknown cost is charged: a 12-megapixel photo.
DEFAULT_COST = 12_000_000
# What every photo costs besides its pixels (a claim, a download, a publish, two exchanges
# with a render process: about 10 ms of CPU, what rendering 0.5 MP costs), charged on top of
# its cost. Without it a 64×48 avatar was charged 3,072 and one tenant of avatars held the
# lane for 650 photos a turn (several seconds) while the others waited; with it, 4.
PHOTO_CHARGE = 500_000
# One turn's credit per unit of weight. A turn ends once its credit is spent; its last photo
# may overdraw it and the debt is paid from the next turns (a tenant in debt is passed over),
# so a quantum small against a photo interleaves tenants finely and a pick stays amortized
# O(1): a debt of k quanta needs a photo of k quanta to arise.
QUANTUM = 2_000_000


@dataclass(frozen=True)
class Pending:
    """One bulk photo waiting in PostgreSQL; `cost` is pixels or bytes (None: unknown);
    `traceparent` its row's trace context, which its entry carries (None: untraced)."""

    photo_id: uuid.UUID
    tenant: str
    cost: int | None = None
    traceparent: str | None = None

    @property
    def charge(self) -> int:
        return (DEFAULT_COST if self.cost is None else self.cost) + PHOTO_CHARGE


@dataclass(frozen=True)
class Refill:
    """The tenant at the head of the ring has no photo loaded: load its oldest ones."""

    tenant: str


@dataclass
class _Tenant:
    weight: int
    deficit: int = 0
    fresh_turn: bool = True
    loaded: deque[Pending] = field(default_factory=deque)


class Scheduler:
    """Deficit round robin with an active ring: only backlogged tenants under their
    in-flight cap are in it, so a pick costs O(1) (amortized) whatever the number of tenants.
    A tenant that arrives joins the ring's tail: it starts within one round."""

    def __init__(self, weights: Mapping[str, int] | None = None, max_in_flight: int = 0) -> None:
        self.weights = dict(weights or {})
        self.max_in_flight = max_in_flight  # 0: no cap
        self.in_flight: dict[str, int] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._ring: deque[str] = deque()
        self._parked: set[str] = set()
        self._held: frozenset[str] = frozenset()  # paused tenants: parked, as if capped
        self._throttled: set[str] = set()  # over their rate: out of the ring until released

    def __len__(self) -> int:
        """Backlogged tenants known (in the ring or parked at their cap)."""
        return len(self._tenants)

    def knows(self, tenant: str) -> bool:
        return tenant in self._tenants

    def add(self, tenant: str) -> None:
        """A tenant with photos waiting; a tenant already known keeps its place."""
        if tenant not in self._tenants:
            self._tenants[tenant] = _Tenant(max(1, self.weights.get(tenant, 1)))
            self._enter(tenant)

    def refill(self, tenant: str, photos: list[Pending]) -> None:
        """The head tenant's oldest photos; none means its backlog is empty: it leaves."""
        if photos:
            self._tenants[tenant].loaded.extend(photos)
            return
        self._ring.popleft()
        del self._tenants[tenant]  # an idle flow keeps no credit (classic DRR)

    def next(self) -> Pending | Refill | None:
        """The next photo to start, a tenant to load first, or None (nothing may start)."""
        while self._ring:
            tenant = self._ring[0]
            state = self._tenants[tenant]
            if state.fresh_turn:
                state.deficit += QUANTUM * state.weight
                state.fresh_turn = False
            if state.deficit <= 0:
                self._end_turn(state)
            elif not state.loaded:
                return Refill(tenant)
            else:
                return self._start(tenant, state)
        return None

    def settle(self, in_flight: Mapping[str, int]) -> None:
        """The tenants' photos in flight, as counted now; tenants back under the cap rejoin."""
        self.in_flight = dict(in_flight)
        for tenant in [t for t in self._parked if not self._capped(t)]:
            self._parked.discard(tenant)
            self._enter(tenant)

    def give_back(self, tenant: str, photos: list[Pending]) -> None:
        """Photos picked but not started (the tenant's rate refused them): first in its
        line again, their charge and in-flight count undone."""
        state = self._tenants[tenant]
        state.loaded.extendleft(reversed(photos))
        state.deficit += sum(photo.charge for photo in photos)
        self.in_flight[tenant] = max(0, self.in_flight.get(tenant, 0) - len(photos))

    def throttle(self, tenant: str) -> None:
        """Out of the ring until `unthrottle`: the others take its turns (work conserving).
        It keeps its photos and, like a capped tenant, no credit saved up meanwhile."""
        if tenant not in self._tenants or tenant in self._throttled:
            return
        if tenant in self._ring:  # O(ring): once per batch a held tenant, not per photo
            self._ring.remove(tenant)
        self._parked.discard(tenant)
        self._throttled.add(tenant)
        state = self._tenants[tenant]
        state.deficit = min(state.deficit, 0)

    def unthrottle(self, tenant: str, first: bool = False) -> None:
        """Back into the ring (parked, if paused or at its cap): at its tail, or `first` at
        its head (its bucket has room now, and it lost its turns while held: a late turn is
        credit its bucket cannot keep, past its burst)."""
        if tenant in self._throttled:
            self._throttled.discard(tenant)
            self._enter(tenant, first)

    def hold(self, tenants: frozenset[str]) -> None:
        """The paused tenants: none of their photos starts (they keep no credit while held,
        as a capped tenant), and those no longer paused rejoin the ring's tail."""
        if tenants == self._held:
            return
        self._held = tenants
        for tenant in [t for t in self._ring if t in tenants]:
            self._ring.remove(tenant)
            self._tenants[tenant].deficit = min(self._tenants[tenant].deficit, 0)
            self._parked.add(tenant)
        self.settle(self.in_flight)

    def _start(self, tenant: str, state: _Tenant) -> Pending:
        photo = state.loaded.popleft()
        state.deficit -= photo.charge
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        if self._capped(tenant):
            self._ring.popleft()
            state.deficit = min(state.deficit, 0)  # no credit saved up while parked
            self._parked.add(tenant)
        return photo

    def _end_turn(self, state: _Tenant) -> None:
        self._ring.rotate(-1)
        state.fresh_turn = True

    def _enter(self, tenant: str, first: bool = False) -> None:
        if self._capped(tenant):
            self._parked.add(tenant)
            return
        if first and self._ring:  # the head's turn resumes after it, credit and all
            self._ring.appendleft(tenant)
        else:
            self._ring.append(tenant)
        self._tenants[tenant].fresh_turn = True

    def _capped(self, tenant: str) -> bool:
        if tenant in self._held:
            return True
        return bool(self.max_in_flight) and self.in_flight.get(tenant, 0) >= self.max_in_flight
