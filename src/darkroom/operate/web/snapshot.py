"""A value shared by every request for a while: the overview's and /metrics' numbers are
loaded at most once per `max_age_s`, however many viewers and scrapers ask, and requests
that arrive during a load wait for that same load (single flight)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

from darkroom.errors import DarkroomError

T = TypeVar("T")


def is_fresh(taken_s: float, now_s: float, max_age_s: float) -> bool:
    return now_s - taken_s < max_age_s


class Snapshot(Generic[T]):
    """The last result of `load`. A failed load (a dependency down) is kept as long as a
    value would be, so an outage costs one attempt per `max_age_s`, not one per request."""

    def __init__(
        self,
        load: Callable[[], Awaitable[T]],
        max_age_s: float,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load, self.max_age_s, self._now = load, max_age_s, now
        self._lock = anyio.Lock()
        self._taken_s = -math.inf
        self._result: T | DarkroomError | None = None
        self.loads = 0

    async def get(self) -> T:
        if not self._fresh():
            # Ordering: the check is repeated under the lock, so the requests that queued
            # behind a load take its result instead of loading again.
            async with self._lock:
                if not self._fresh():
                    await self._refresh()
        return self._value()

    def expire(self) -> None:
        """An action changed what it shows: the next get loads anew."""
        self._taken_s = -math.inf

    def _fresh(self) -> bool:
        return is_fresh(self._taken_s, self._now(), self.max_age_s)

    async def _refresh(self) -> None:
        self.loads += 1
        try:
            self._result = await self._load()
        except DarkroomError as exc:
            self._result = exc
        self._taken_s = self._now()

    def _value(self) -> T:
        if isinstance(self._result, DarkroomError):
            # a fresh instance per request: re-raising one would pile up tracebacks
            raise type(self._result)(str(self._result), reason=self._result.reason)
        assert self._result is not None
        return self._result
