"""Pure retry policy: what a failure costs a photo. An attempt is counted in PostgreSQL by
the claim (photo_jobs.attempt); this module decides from that count, never from the
stream's delivery count, which stays only as a generous backstop.

A transient error of a dependency that answers its probe waits in place with capped
backoff and counts nothing, until the photo's transient streak passes
DARKROOM_TRANSIENT_BUDGET_S. A counted failure is retried on the stream with exponential
backoff and "equal jitter", capped by the claim idle time: XCLAIM IDLE can only make an
entry look older, so XAUTOCLAIM can delay a retry by at most DARKROOM_CLAIM_IDLE_MS.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from darkroom.errors import DarkroomError

# Any other dependency error while the dependency answers its probe gets this many quick
# retries in place (0.5 s, then 1 s) before it ends the attempt as the photo's own failure.
IN_PLACE_RETRIES = 2
# Waits in place for a transient error: 0.25 s doubling to 10 s (the gate's pace).
TRANSIENT_BASE_MS, TRANSIENT_CAP_MS = 250, 10_000
# Deliveries of one entry past which it is given up whatever PostgreSQL says: only a
# failure before any claim (which PostgreSQL cannot count) comes near it, since lost
# replies, own reclaims and reclaims from a live owner add deliveries but no attempt.
BACKSTOP_FACTOR, BACKSTOP_EXTRA = 4, 10


@dataclass(frozen=True)
class Retry:
    delay_ms: int


@dataclass(frozen=True)
class DeadLetter:
    code: str


def backoff_ms(attempt: int, base_ms: int, cap_ms: int, rand: Callable[[], float]) -> int:
    """base·2^(n−1), capped, then uniformly in its upper half (never a thundering herd)."""
    full = min(cap_ms, base_ms * 2 ** min(max(0, attempt - 1), 30))
    return int(full / 2 + rand() * full / 2)


def decide(
    attempt: int,
    error: DarkroomError,
    *,
    max_attempts: int,
    base_ms: int,
    cap_ms: int,
    rand: Callable[[], float] = random.random,
) -> Retry | DeadLetter:
    """How an attempt that ended in `error` goes on. A transient error ends an attempt only
    once its budget is spent (it waited in place until then): final, with its own code."""
    if not error.retryable or error.transient or attempt >= max_attempts:
        return DeadLetter(error.code)
    return Retry(backoff_ms(attempt, base_ms, cap_ms, rand))


def in_place_ms(
    error: DarkroomError,
    retries: int,
    streak_s: float,
    *,
    budget_s: float,
    rand: Callable[[], float] = random.random,
) -> int | None:
    """A dependency error while the dependency answers its probe: how long to wait before
    retrying in place (nothing counted), or None when it ends the attempt. `retries`: in
    place so far; `streak_s`: age of the photo's streak of transient errors."""
    if error.transient:
        if streak_s >= budget_s:
            return None
        return backoff_ms(retries + 1, TRANSIENT_BASE_MS, TRANSIENT_CAP_MS, rand)
    return None if retries >= IN_PLACE_RETRIES else TRANSIENT_BASE_MS * 2 ** (retries + 1)


def past_backstop(deliveries: int, max_attempts: int) -> bool:
    return deliveries > BACKSTOP_FACTOR * max_attempts + BACKSTOP_EXTRA


def heartbeat_s(claim_idle_ms: int) -> float:
    """How often a worker refreshes its in-flight entries (stream) and leases (PostgreSQL)."""
    return min(claim_idle_ms / 3000, 10.0)


def lease_ms(claim_idle_ms: int) -> int:
    """Two heartbeats: a live owner renews it in time with one to spare, and it is shorter
    than the claim idle time by at least one heartbeat, so the lease of a dead owner has run
    out by the time XAUTOCLAIM can hand its entry to another worker."""
    return int(2 * heartbeat_s(claim_idle_ms) * 1000)


def preset_idle_ms(claim_idle_ms: int, delay_ms: int) -> int:
    """Idle time to give a failed entry so XAUTOCLAIM(min_idle=claim_idle) takes it after delay."""
    return max(0, claim_idle_ms - delay_ms)
