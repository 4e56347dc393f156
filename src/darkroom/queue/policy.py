"""Pure retry policy: (deliveries so far, error) → Retry(delay) or DeadLetter(code).

The stream's delivery count is the attempt counter. Backoff is exponential with
"equal jitter" and capped by the claim idle time, because XCLAIM IDLE can only make an
entry look older, so XAUTOCLAIM can delay a retry by at most DARKROOM_CLAIM_IDLE_MS.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from darkroom.errors import DarkroomError


@dataclass(frozen=True)
class Retry:
    delay_ms: int


@dataclass(frozen=True)
class DeadLetter:
    code: str


def backoff_ms(deliveries: int, base_ms: int, cap_ms: int, rand: Callable[[], float]) -> int:
    """base·2^(n−1), capped, then uniformly in its upper half (never a thundering herd)."""
    full = min(cap_ms, base_ms * 2 ** max(0, deliveries - 1))
    return int(full / 2 + rand() * full / 2)


def decide(
    deliveries: int,
    error: DarkroomError,
    *,
    max_attempts: int,
    base_ms: int,
    cap_ms: int,
    rand: Callable[[], float] = random.random,
) -> Retry | DeadLetter:
    if not error.retryable or deliveries >= max_attempts:
        return DeadLetter(error.code)
    return Retry(backoff_ms(deliveries, base_ms, cap_ms, rand))


def preset_idle_ms(claim_idle_ms: int, delay_ms: int) -> int:
    """Idle time to give a failed entry so XAUTOCLAIM(min_idle=claim_idle) takes it after delay."""
    return max(0, claim_idle_ms - delay_ms)
