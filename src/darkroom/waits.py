"""A delivery's waits in place, around its processing until the ack: a dependency outage
(health.Gate) is waited out and a transient error waits in place (a few quick retries for
another dependency error), so none of them costs the photo an attempt; once the policy
allows no more (a transient streak past DARKROOM_TRANSIENT_BUDGET_S), the error is the
attempt's, failed by Jobs. Mixed into Jobs (jobs.py), which owns the state it reads and the
processing it retries.

Ordering hazards: once the publish committed, only the ack is retried. A stop while the
entry waits leaves it pending (LeftPending), and a stop that cuts the work short gives the
claim back, shielded and brief: it was not the photo's attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import structlog

from darkroom import metrics, tracing
from darkroom.errors import DarkroomError
from darkroom.health import DEPENDENCIES, Gate, declared
from darkroom.queue import policy
from darkroom.queue.inflight import InFlight
from darkroom.queue.messages import Entry
from darkroom.queue.streams import Streams
from darkroom.recorder import Recorder
from darkroom.settings import Settings
from darkroom.store import db, history, leases

log = structlog.get_logger("darkroom.jobs")

# Giving a claim back at a stop waits at most this long (the process is on its way out).
RELEASE_DEADLINE_S = 2.0
# Outcomes whose entry is not this delivery's to ack: a live owner's (busy), a newer lease's
# (lease_lost), a paused scope's (paused: left pending for after the resume).
NOT_OURS = frozenset({"busy", "lease_lost", "paused"})


class LeftPending(Exception):
    """Stopping while the entry waited (through an outage, or to retry in place): leave it
    pending for whoever comes next. Its message says which."""


@dataclass
class Streak:
    """One delivery's waits in place: how many so far, and where the photo's streak of
    transient errors started by this worker's clock (re-anchored on PostgreSQL's, which
    keeps it across restarts and reclaims, whenever the database answers)."""

    retries: int = 0
    started_s: float | None = None
    restart: bool = False  # an outage ended the last streak: the next error starts anew


class WaitsInPlace:
    """Jobs's waits in place (see the module's docstring); the attributes are Jobs's."""

    settings: Settings
    pool: db.Pool
    gate: Gate
    stopping: anyio.Event
    in_flight: InFlight[leases.Claim]
    recorder: Recorder

    def _stream(self, entry: Entry) -> Streams:
        raise NotImplementedError  # Jobs's

    async def _process(self, entry: Entry, deliveries: int) -> str:
        raise NotImplementedError  # Jobs's

    async def _resilient(self, entry: Entry, deliveries: int) -> str:
        """Process and ack. A stop that cuts the work short gives the claim back: it was not
        the photo's attempt."""
        try:
            return await self._until_acked(entry, deliveries)
        except (LeftPending, anyio.get_cancelled_exc_class()):
            await self._release(entry)
            raise

    async def _until_acked(self, entry: Entry, deliveries: int) -> str:
        """An outage is waited out (an error that is the deployment's is one whatever the
        probe says), a transient error waits in place, another dependency error gets a few
        quick retries in place; none of them counts an attempt."""
        streak = Streak()
        outcome = None  # once committed, only the ack is retried
        while True:
            try:
                outcome = outcome or await self._process(entry, deliveries)
                if outcome not in NOT_OURS:
                    with tracing.span("ack"):
                        await self._stream(entry).ack(entry.id)
                return outcome
            except DarkroomError as exc:
                if exc.stage not in DEPENDENCIES or not exc.retryable:
                    raise
                outage = await self._pause(entry, exc, streak)
                if self.stopping.is_set():
                    raise LeftPending(_left(exc, outage)) from exc

    async def _pause(self, entry: Entry, exc: DarkroomError, streak: Streak) -> bool:
        """Wait before the next try in place, or raise when `exc` ends the attempt; True if
        an outage was waited out. Never back to back: the policy's delays grow from 0.25 s."""
        if await self.gate.wait(exc.stage, exc if declared(exc) else None):
            streak.restart = True  # an outage, waited out: not the photo's streak
            return True
        streak_s = await self._streak_s(entry, exc, streak)
        budget_s = self.settings.transient_budget_s
        delay_ms = policy.in_place_ms(exc, streak.retries, streak_s, budget_s=budget_s)
        if delay_ms is None:
            if exc.transient:
                raise _budget_spent(exc, streak_s, budget_s) from exc
            raise exc
        streak.retries += 1
        await self._wait_in_place(entry, exc, delay_ms, streak_s)
        return False

    async def _wait_in_place(
        self, entry: Entry, exc: DarkroomError, delay_ms: int, streak_s: float
    ) -> None:
        if exc.transient:
            metrics.TRANSIENT_WAITS.labels(exc.code, exc.reason).inc()
        event = "transient error; waiting in place" if exc.transient else "retrying in place"
        log.warning(event, entry_id=entry.id, error_code=exc.code, reason=exc.reason,
                    error=str(exc), delay_ms=delay_ms, transient_s=round(streak_s, 1))  # fmt: skip
        await self.gate.clock.sleep(delay_ms / 1000, self.stopping)

    async def _streak_s(self, entry: Entry, exc: DarkroomError, streak: Streak) -> float:
        """Age of the photo's streak of transient errors (none for any other error)."""
        if not exc.transient:
            return 0.0
        now_s = self.gate.clock.now()
        if streak.started_s is None or streak.restart:
            streak.started_s = now_s
        claim = self.in_flight.claim_of(entry.id)
        if claim is not None and claim.outcome == "claimed":
            try:
                age_s = await leases.transient_streak_s(
                    self.pool, claim.photo_id, claim.token, streak.restart
                )
            except DarkroomError:
                age_s = None  # the database is what fails: this worker's clock meanwhile
            if age_s is not None:
                streak.started_s = now_s - age_s
        streak.restart = False
        return now_s - streak.started_s

    async def _release(self, entry: Entry) -> None:
        """Shielded and brief: if PostgreSQL does not answer, the claim stays counted."""
        claim = self.in_flight.claim_of(entry.id)
        if claim is None or claim.outcome != "claimed":
            return
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + RELEASE_DEADLINE_S
            try:
                await leases.release(self.pool, claim.photo_id, claim.token)
            except DarkroomError as exc:
                log.warning("could not give the claim back; it counts as an attempt",
                            entry_id=entry.id, error=str(exc))  # fmt: skip
            await self.recorder.end(entry, history.Ending("released"))


def _left(exc: DarkroomError, outage: bool) -> str:
    if outage:
        return f"stopping during an outage ({exc.stage} {exc.reason}); entry left pending"
    return f"stopping while retrying in place ({exc.code} {exc.reason}); entry left pending"


def _budget_spent(exc: DarkroomError, streak_s: float, budget_s: float) -> DarkroomError:
    """The dependency's own error, final: transient for longer than the budget."""
    message = (f"transient errors for {streak_s:.0f} s, past DARKROOM_TRANSIENT_BUDGET_S"
               f" ({budget_s:g} s); the last: {exc}")  # fmt: skip
    return type(exc)(message, reason=exc.reason, transient=True)
