"""Leased single runners: each duty (the feeder, the relay, the sweep, the history prune)
is done by one worker at a time, the holder of its lease in darkroom_duties
(store/duties.py). A runner takes the lease, renews it every lease/3 (a candidate asks as
often, at most 2 s apart), and cancels the work at once when a renewal is refused or the
lease runs out unrenewed; the work's writes that matter carry the lease's token (a Fence),
so a holder that wakes after a takeover is refused.

Ordering hazards: the local deadline counts from before the statement that set the lease
(the database's expiry is never earlier than ours); a lost duty is released by nobody (the
new holder's row is not ours to touch: release is fenced too).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import structlog

from darkroom import metrics
from darkroom.errors import DarkroomError
from darkroom.queue.pacing import Backoff, Throttle
from darkroom.store import db, duties

log = structlog.get_logger("darkroom.duty")

RELEASE_TIMEOUT_S = 5.0  # a stop never waits longer for the database to hear it
REPEAT_LOG_EVERY_S = 10.0
# A candidate asks at least this often (a cheap primary-key statement), so a takeover comes
# at most this long after the lease ran out, whatever the lease.
MAX_RETRY_S = 2.0
FAILURE_CAP_S = 30.0


def process_holder(consumer: str) -> str:
    """A holder name unique per process (a consumer name may be reused by a restart),
    readable in `status`: the consumer name and a random suffix."""
    return f"{consumer}/{uuid.uuid4().hex[:8]}"


@dataclass
class Tenure:
    """One holding of a duty: the fence its writes carry, and the local deadline its lease
    is known to run until (anyio's clock), moved by each renewal."""

    duty: str
    fence: duties.Fence
    until_s: float
    scope: anyio.CancelScope
    lost: bool = False

    def live(self) -> bool:
        """Checked before each batch: False once lost, or once the deadline passed without
        a renewal (a process that was frozen wakes here before its heartbeat does)."""
        if not self.lost and anyio.current_time() >= self.until_s:
            self.lose("unrenewed")
        return not self.lost

    def lose(self, reason: str) -> None:
        """Stop the duty's work at once (its cancel scope); said once per holding."""
        if self.lost:
            return
        self.lost = True
        metrics.DUTY_LOST.labels(self.duty).inc()
        log.warning("duty lost", duty=self.duty, holder=self.fence.holder,
                    token=self.fence.token, reason=reason)  # fmt: skip
        self.scope.cancel()


Work = Callable[[Tenure], Awaitable[None]]


@dataclass
class Duty:
    """The runner of one duty for this process."""

    name: str
    pool: db.Pool
    holder: str
    lease_s: float
    tenure: Tenure | None = None  # while this process holds the duty

    @property
    def renew_s(self) -> float:
        """How often the holder renews: two renewals may fail before the lease runs out."""
        return self.lease_s / 3

    @property
    def retry_s(self) -> float:
        """How often a candidate asks: a takeover comes within the lease and one retry
        after the holder's last renewal."""
        return min(self.lease_s / 3, MAX_RETRY_S)

    async def run(self, work: Work, stopping: anyio.Event | None = None) -> None:
        """Until `stopping` is set (or cancelled): take the duty whenever it is free and do
        `work` while it is held. A failure releases it and backs off; never ends."""
        stopping = stopping or anyio.Event()
        backoff, throttle = Backoff(self.retry_s, FAILURE_CAP_S), Throttle(REPEAT_LOG_EVERY_S)
        while not stopping.is_set():
            delay_s = self.retry_s
            try:
                async with self.hold() as tenure:
                    if tenure is not None:
                        await work(tenure)
                backoff.reset()
                throttle.clear()
            except Exception as exc:  # a bug must not end the worker either: it backs off
                if (known := ours(exc)) is None:
                    log.exception("duty failed unexpectedly", duty=self.name)
                elif (quiet := throttle.allow(known.code, anyio.current_time())) is not None:
                    log.warning("duty failed", duty=self.name, error_code=known.code,
                                error=str(known), repeats_not_logged=quiet)  # fmt: skip
                delay_s = backoff.next_s()
            with anyio.move_on_after(delay_s):
                await stopping.wait()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[Tenure | None]:
        """The duty for the body, with its heartbeat; None if another holder's lease runs
        (or this process holds it already).
        A loss cancels the body (the block ends early, without an exception); a failure
        of the body gives the duty up and is raised as it was."""
        if self.tenure is not None:  # one holding per process: another pass is under way
            yield None
            return
        started_s = anyio.current_time()
        token = await duties.acquire(self.pool, self.name, self.holder, self.lease_s)
        if token is None:
            yield None
            return
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            fence = duties.Fence(self.name, self.holder, token)
            tenure = Tenure(self.name, fence, started_s + self.lease_s, tg.cancel_scope)
            self._taken(tenure)
            tg.start_soon(self._heartbeat, tenure)
            try:
                yield tenure
            except Exception as exc:  # raised below as it is, not in an exception group
                failure = exc
            finally:
                tg.cancel_scope.cancel()
                await self._let_go(tenure)
        if failure is not None:
            raise failure

    def _taken(self, tenure: Tenure) -> None:
        self.tenure = tenure
        metrics.DUTY_HELD.labels(self.name).set(1)
        log.info("duty taken", duty=self.name, holder=self.holder, token=tenure.fence.token)

    async def _let_go(self, tenure: Tenure) -> None:
        """Release (fenced: a lost lease is not ours to end), shielded and bounded: a stop
        must end, and a database that does not answer lets the lease run out instead."""
        self.tenure = None
        metrics.DUTY_HELD.labels(self.name).set(0)
        if tenure.lost:
            return
        with anyio.move_on_after(RELEASE_TIMEOUT_S, shield=True):
            with contextlib.suppress(DarkroomError):
                await duties.release(self.pool, tenure.fence)

    async def _heartbeat(self, tenure: Tenure) -> None:
        """Renew every lease/3; refused: lost at once; failing: lost at the deadline. Each
        renewal waits at most until the deadline (a hung connection must not hold it)."""
        while tenure.live():
            await anyio.sleep(self.renew_s)
            sent_s = anyio.current_time()
            renewed: bool | None = None
            with anyio.move_on_after(max(0.0, tenure.until_s - sent_s)):
                with contextlib.suppress(DarkroomError):
                    renewed = await duties.renew(self.pool, tenure.fence, self.lease_s)
            if renewed is False:
                tenure.lose("refused")
            elif renewed:
                tenure.until_s = sent_s + self.lease_s


def ours(exc: BaseException) -> DarkroomError | None:
    """The error a duty reports by its code: a DarkroomError, or the first of a task
    group's errors when every one of them is (the feeder's work runs beside a watcher
    task, so an outage reaches it wrapped in an ExceptionGroup); None for anything else."""
    if isinstance(exc, DarkroomError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        known, rest = exc.split(DarkroomError)
        if known is not None and rest is None:
            return ours(known.exceptions[0])
    return None
