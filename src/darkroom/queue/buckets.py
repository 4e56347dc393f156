"""The tenants' rate buckets in Redis: a generic cell rate algorithm (GCRA) per tenant,
charged for a whole batch of tenants in one script call (one round trip), its keys in
the bulk stream's hash slot. Redis holds only each bucket's theoretical arrival time;
a bucket lost (a wipe, an expiry) comes back full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from darkroom.queue.limits import Rate
from darkroom.queue.streams import Client, translated

# KEYS: one bucket per tenant; ARGV[1] now in ms ('' = Redis's clock: one clock for every
# replica's feeder), then for each key: ms per photo, burst, photos wanted, force (1: charge
# them all, even into debt). Each key's TAT (theoretical arrival time, ms) moves by the
# photos admitted; a photo conforms while TAT - now <= burst × interval after it. Returns
# per key {admitted, ms until the next photo would conform}. A key expires once its
# bucket is full again (TAT in the past), so idle tenants cost no memory.
GCRA_LUA = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local out = {}
for i = 1, #KEYS do
  local at = 2 + (i - 1) * 4
  local interval, burst = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  local want, force = tonumber(ARGV[at + 2]), ARGV[at + 3] == '1'
  local tat = math.max(tonumber(redis.call('GET', KEYS[i]) or '0'), now)
  local room = math.floor((now + burst * interval - tat) / interval + 1e-9)
  local admitted = want
  if not force then admitted = math.max(0, math.min(want, room)) end
  if admitted > 0 then
    tat = tat + admitted * interval
    redis.call('SET', KEYS[i], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
  end
  out[i] = {admitted, math.ceil(math.max(0, tat + interval - burst * interval - now))}
end
return out
"""


@dataclass(frozen=True)
class Charge:
    """`photos` of `tenant` to start now at `rate`; `force`: start them all whatever the
    bucket holds (they are charged, and the tenant's later photos wait for them)."""

    tenant: str
    rate: Rate
    photos: int
    force: bool = False


class Buckets:
    """The buckets of one bulk stream's tenants. `now_ms`: a clock for tests (None: the
    Redis server's, the same for every feeder that takes over)."""

    def __init__(
        self, client: Client, stream: str, now_ms: Callable[[], float] | None = None
    ) -> None:
        self.client, self.prefix, self.now_ms = client, f"{stream}:rate:", now_ms
        self._script: Any = None

    def key(self, tenant: str) -> str:
        return self.prefix + tenant

    @translated
    async def take(self, charges: Sequence[Charge]) -> list[tuple[int, float]]:
        """For each charge, the photos admitted (from the first) and the seconds until the
        tenant's next photo conforms; one script call for all of them."""
        if not charges:
            return []
        if self._script is None:
            self._script = self.client.register_script(GCRA_LUA)
        now = "" if self.now_ms is None else f"{self.now_ms():.3f}"
        args: list[str | int] = [now]
        for c in charges:
            args += [f"{c.rate.interval_ms:.6f}", c.rate.photos_at_once, c.photos, int(c.force)]
        replies = await self._script(keys=[self.key(c.tenant) for c in charges], args=args)
        return [(int(admitted), int(wait_ms) / 1000) for admitted, wait_ms in replies]
