"""Pure pacing for every loop that retries: capped exponential backoff with jitter, and a
log throttle that says a repeated failure once per change, then at most every few
seconds with the count it kept quiet. No loop may retry at once or log once per turn.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """base·2^n seconds, capped, each delay uniform in its upper half (no herd)."""

    base_s: float = 0.25
    cap_s: float = 10.0
    rand: Callable[[], float] = field(default=random.random, repr=False)
    failures: int = 0

    def next_s(self) -> float:
        full = min(self.cap_s, self.base_s * 2 ** min(self.failures, 30))
        self.failures += 1
        return float(full / 2 + self.rand() * full / 2)

    def reset(self) -> None:
        self.failures = 0


@dataclass
class Throttle:
    """Decides which repeats of a failure get a log line."""

    every_s: float = 10.0
    _key: str | None = None
    _last_s: float = -math.inf
    _quiet: int = 0

    def allow(self, key: str, now_s: float) -> int | None:
        """None: stay quiet. Otherwise log, saying how many repeats went unlogged."""
        if key != self._key or now_s - self._last_s >= self.every_s:
            quiet, self._quiet = self._quiet, 0
            self._key, self._last_s = key, now_s
            return quiet
        self._quiet += 1
        return None

    def clear(self) -> None:
        """The failure is over: its next occurrence is news again."""
        self._key, self._quiet = None, 0
