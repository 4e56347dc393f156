"""The feeder's rate limits: each tenant's own rate (store/limits.py, the truth, loaded
by `load_limits`), its bucket (queue/buckets.py) charged as its photos are XADDed, once per
batch, and for its interactive uploads, and a tenant over its rate held out of the fair
order (queue/limits.py's Throttle) until its bucket has room. Mixed into Feeder
(feeder.py), which owns the state it reads and the picking and feeding it calls.

Ordering hazards: a photo its bucket refuses goes back to the head of its tenant's line
before the batch is fed: it is never marked fed, so never lost. A released tenant is fed as
soon as the reserve has room (`_feed_owed`), only within the reserve.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from darkroom import metrics
from darkroom.health import Clock
from darkroom.queue.buckets import Buckets, Charge
from darkroom.queue.horizon import INTAKE_GRACE_MS
from darkroom.queue.limits import Rate, Throttle
from darkroom.queue.scheduler import Pending, Scheduler
from darkroom.store import intake, limits


class RateLimits:
    """Feeder's rate limits (see the module's docstring); the attributes are Feeder's."""

    clock: Clock
    scheduler: Scheduler
    throttle: Throttle
    buckets: Buckets
    named: frozenset[str]
    _uploads_after: datetime | None
    _owed: set[str]

    async def _pick(self, conn: intake.Connection, most: int) -> list[Pending]:
        raise NotImplementedError  # Feeder's

    async def _feed_picked(self, conn: intake.Connection, picked: list[Pending]) -> bool:
        raise NotImplementedError  # Feeder's

    async def load_limits(self, conn: intake.Connection) -> None:
        """The tenants' own rates from PostgreSQL (the truth); a change releases every
        held tenant, which its bucket then judges again."""
        own = {t: Rate(lim.per_s, lim.burst, lim.interactive)
               for t, lim in limits.limits_of(await limits.listed(conn)).items()}  # fmt: skip
        for tenant in self.throttle.load(own):
            self.scheduler.unthrottle(tenant)

    async def charge_interactive(self, conn: intake.Connection) -> None:
        """Tenants charged for their interactive photos (`limits set --interactive`): the
        uploads since the last look, charged whatever the bucket holds (an upload is never
        delayed; the tenant's bulk photos wait off the debt). From a takeover on: a dead
        feeder's last window is not charged (an undercharge, never a double charge)."""
        tenants = [t for t, rate in self.throttle.own.items() if rate.interactive and rate.limited]
        counts, self._uploads_after = await limits.interactive_uploads(
            conn, tenants, self._uploads_after, INTAKE_GRACE_MS / 1000
        )
        charges = [Charge(t, self.throttle.rate_of(t), n, force=True) for t, n in counts.items()]
        await self.buckets.take(charges)

    def _released(self) -> list[str]:
        """Held tenants whose bucket has room again: back at the ring's head."""
        released = self.throttle.due(self.clock.now())
        for tenant in released:
            self.scheduler.unthrottle(tenant, first=True)
        return released

    async def _feed_owed(self, conn: intake.Connection, room: int) -> None:
        """Released tenants are fed as soon as the reserve has room, not at the next top-up
        (half of it taken): a bucket left full loses the credit past its burst, and the
        tenant would fall short of its rate. Only their photos, within the reserve, so a
        limit never buys a tenant more than the reserve; the others' picks go back."""
        owed, self._owed = self._owed, set()
        most = min(room, sum(self.throttle.rate_of(t).photos_at_once for t in owed))
        picked = await self._pick(conn, most)
        for tenant, photos in _by_tenant([p for p in picked if p.tenant not in owed]).items():
            self.scheduler.give_back(tenant, photos)
        if admitted := await self._within_rates([p for p in picked if p.tenant in owed]):
            await self._feed_picked(conn, admitted)

    async def _within_rates(self, picked: list[Pending]) -> list[Pending]:
        """The photos picked that their tenants' buckets admit (one script call for the
        batch); the rest go back to the head of their tenant's line and the tenant is held
        until its bucket has room. A photo refused is never lost: it is not marked fed."""
        by_tenant = _by_tenant(picked)
        rates = {tenant: self.throttle.rate_of(tenant) for tenant in by_tenant}
        charges = [Charge(t, rates[t], len(by_tenant[t])) for t in by_tenant if rates[t].limited]
        refused: set[uuid.UUID] = set()
        answers = await self.buckets.take(charges)
        for charge, (admitted, wait_s) in zip(charges, answers, strict=True):
            if admitted < charge.photos:
                self._hold(charge.tenant, by_tenant[charge.tenant][admitted:], wait_s)
                refused.update(p.photo_id for p in by_tenant[charge.tenant][admitted:])
        return [photo for photo in picked if photo.photo_id not in refused]

    def _hold(self, tenant: str, photos: list[Pending], wait_s: float) -> None:
        self.scheduler.give_back(tenant, photos)
        self.scheduler.throttle(tenant)
        self.throttle.hold(tenant, self.clock.now() + wait_s)
        # A label of its own for a tenant weighted or with its own rate: operators name few.
        own = tenant in self.named or tenant in self.throttle.own
        metrics.THROTTLED.labels(tenant if own else metrics.OTHER_TENANT).inc()


def _by_tenant(photos: list[Pending]) -> dict[str, list[Pending]]:
    by_tenant: dict[str, list[Pending]] = {}
    for photo in photos:
        by_tenant.setdefault(photo.tenant, []).append(photo)
    return by_tenant
