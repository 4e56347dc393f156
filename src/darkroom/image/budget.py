"""The render slots' shared memory budget: a render starts only when its estimated decode
memory (image/footprint.py) fits beside the renders already running.

`MemoryBudget` is owned by the render pool (image/renderer.py), which asks for a photo's
share once the photo holds its slot and gives it back when the render ends, however it
ends. Admission is first come, first served: a photo that does not fit waits, and every
photo that asks after it waits behind it even when it would fit, so a large photo is never
overtaken for ever by small ones. Interactive photos go ahead of waiting bulk ones (as they
do for slots), in their own arrival order. A photo larger than the whole budget asks for all
of it: it renders alone, never refused for its size. A tiny photo (estimated at most
OUTSIDE_MB) renders outside the budget: it neither waits nor counts, so small thumbnails and
icons keep flowing beside a photo that holds it all; what it adds is within the variation of
a render process's idle size.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

# A 64×48 PNG's render adds about 4 MB, a 0.2 MP photo's 4–6 MB (image/footprint.py)
OUTSIDE_MB = 8


@dataclass(eq=False)
class _Waiter:
    mb: int
    interactive: bool
    admitted: anyio.Event = field(default_factory=anyio.Event)


def _ignore(_: float) -> None:
    return None


class MemoryBudget:
    """`async with budget.held(mb, interactive)`: the body runs with `mb` (at most the
    whole budget) counted in `in_use_mb`."""

    def __init__(self, total_mb: int) -> None:
        self.total_mb = total_mb
        self.in_use_mb = 0
        self.held_mb: list[int] = []  # each running render's share, in admission order
        self._waiting: deque[_Waiter] = deque()
        # metrics hooks, set by the worker (image does not import prometheus_client)
        self.on_use: Callable[[float], object] = _ignore
        self.on_wait: Callable[[float], object] = _ignore

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def share(self, estimate_mb: int) -> int:
        """What a photo estimated at `estimate_mb` takes: over the whole budget, all of it;
        none for a tiny photo."""
        return 0 if estimate_mb <= OUTSIDE_MB else min(estimate_mb, self.total_mb)

    async def take(self, estimate_mb: int, interactive: bool = False) -> int:
        """Wait until the photo's share fits, then count it; returns the share to give back.
        Cancelled while waiting, it takes nothing (and if admitted meanwhile, gives it back)."""
        mb = self.share(estimate_mb)
        if not mb:
            return 0
        if not self._waiting and self._fits(mb):
            self._count(mb)
            return mb
        waiter = _Waiter(mb, interactive)
        self._enqueue(waiter)
        started = time.monotonic()
        try:
            await waiter.admitted.wait()
        except BaseException:
            if waiter.admitted.is_set():
                self.give_back(mb)
            else:
                self._waiting.remove(waiter)
                self._admit()  # the photo behind it may fit now
            raise
        self.on_wait(time.monotonic() - started)
        return mb

    def give_back(self, mb: int) -> None:
        if not mb:
            return
        self.held_mb.remove(mb)
        self.in_use_mb -= mb
        self.on_use(self.in_use_mb)
        self._admit()

    def _fits(self, mb: int) -> bool:
        return self.in_use_mb + mb <= self.total_mb

    def _count(self, mb: int) -> None:
        self.in_use_mb += mb
        self.held_mb.append(mb)
        self.on_use(self.in_use_mb)

    def _enqueue(self, waiter: _Waiter) -> None:
        """At the back; an interactive photo ahead of the first waiting bulk one."""
        if waiter.interactive:
            at = next((i for i, w in enumerate(self._waiting) if not w.interactive), None)
            if at is not None:
                self._waiting.insert(at, waiter)
                return
        self._waiting.append(waiter)

    def _admit(self) -> None:
        """Admit waiters from the front while each fits; the first that does not stops it."""
        while self._waiting and self._fits(self._waiting[0].mb):
            waiter = self._waiting.popleft()
            self._count(waiter.mb)
            waiter.admitted.set()
