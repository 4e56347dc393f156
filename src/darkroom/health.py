"""Dependency health: tells a dependency outage from a photo's own failure.

When Redis, PostgreSQL or storage fails, a probe that exercises what the worker needs (a
write, not a ping) decides. If it fails too, it is an outage: the dependency is marked
down with its reason (/readyz shows it), intake stops taking new work, and the photos
caught in it wait (keeping their slots and their delivery). One task probes, with capped
exponential backoff and a reconnect between probes; the others wait for it. So an outage
never burns attempts, and never spins.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import structlog

from darkroom import metrics
from darkroom.errors import DarkroomError
from darkroom.queue.pacing import Backoff, Throttle
from darkroom.settings import redact

log = structlog.get_logger("darkroom.health")

Probe = Callable[[], Awaitable[None]]
Reconnect = Callable[[], Awaitable[None]]
# Error stages that name a dependency (errors.py): storage, database, queue.
DEPENDENCIES = ("storage", "database", "queue")
PROBE_TIMEOUT_S = 10.0
STILL_DOWN_EVERY_S = 30.0


class Clock(Protocol):
    """Time as the loops see it; tests pass a controlled one."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float, until: anyio.Event) -> None: ...


class RealClock:
    def now(self) -> float:
        return anyio.current_time()

    async def sleep(self, seconds: float, until: anyio.Event) -> None:
        """Sleep, ending early when `until` is set (a stop request)."""
        with anyio.move_on_after(seconds):
            await until.wait()


class Gate:
    def __init__(
        self,
        probes: dict[str, Probe],
        reconnects: dict[str, Reconnect],
        stopping: anyio.Event,
        *,
        clock: Clock | None = None,
        max_backoff_s: float = 10.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.probes, self.reconnects, self.stopping = probes, reconnects, stopping
        self.clock: Clock = clock or RealClock()
        self.max_backoff_s, self.rand = max_backoff_s, rand
        self.down: dict[str, str] = {}  # dependency → what its probe said
        self._recovered = anyio.Event()

    def is_open(self) -> bool:
        return not self.down

    async def check(self, dependency: str) -> DarkroomError | None:
        """Probe once: None when healthy, else the error the probe met."""
        try:
            with anyio.fail_after(PROBE_TIMEOUT_S):
                await self.probes[dependency]()
            return None
        except DarkroomError as exc:
            return exc
        except TimeoutError:
            return DarkroomError(f"probe took longer than {PROBE_TIMEOUT_S:g} s", reason="timeout")
        except Exception as exc:  # an error the adapter's table missed: still not healthy
            return DarkroomError(f"probe: {type(exc).__name__}: {exc}", reason="probe_error")

    async def wait(self, dependency: str) -> bool:
        """Return once `dependency` passes its probe, or the worker is stopping. True if it
        was down (an outage was waited out), False if the first probe passed."""
        if dependency not in self.down:
            problem = await self.check(dependency)
            if problem is None:
                return False
            if dependency not in self.down:
                await self._outage(dependency, problem)
                return True
        while dependency in self.down and not self.stopping.is_set():
            with anyio.move_on_after(1):
                await self._recovered.wait()
        return True

    async def _outage(self, dependency: str, first: DarkroomError) -> None:
        problem: DarkroomError | None = first
        self.down[dependency] = _describe(first)
        metrics.OUTAGES.labels(dependency).inc()
        log.warning("dependency down: pausing intake", dependency=dependency,
                    reason=first.reason, error=str(first))  # fmt: skip
        started, probes = self.clock.now(), 1
        backoff, throttle = (
            Backoff(0.25, self.max_backoff_s, self.rand),
            Throttle(STILL_DOWN_EVERY_S),
        )
        throttle.allow(first.reason, started)
        try:
            while problem is not None:
                await self.clock.sleep(backoff.next_s(), self.stopping)
                if self.stopping.is_set():
                    return
                await self._reconnect(dependency)
                problem, probes = await self.check(dependency), probes + 1
                if problem is not None:
                    self.down[dependency] = _describe(problem)
                    self._still_down(dependency, problem, probes, throttle)
        finally:
            self.down.pop(dependency, None)
            self._recovered.set()
            self._recovered = anyio.Event()
        seconds = round(self.clock.now() - started, 3)
        log.info("dependency back: resuming", dependency=dependency, seconds=seconds, probes=probes)

    async def _reconnect(self, dependency: str) -> None:
        reconnect = self.reconnects.get(dependency)
        if reconnect is not None:
            try:
                await reconnect()
            except Exception as exc:  # a failed reconnect is what the next probe finds
                log.debug("reconnect failed", dependency=dependency, error=str(exc))

    def _still_down(
        self, dependency: str, problem: DarkroomError, probes: int, throttle: Throttle
    ) -> None:
        quiet = throttle.allow(problem.reason, self.clock.now())
        if quiet is not None:
            log.warning("dependency still down", dependency=dependency, reason=problem.reason,
                        error=str(problem), probes=probes)  # fmt: skip


def _describe(problem: DarkroomError) -> str:
    """What /readyz and the logs say of an outage; a password a driver quoted is masked."""
    text = redact(str(problem))
    return (text if text.startswith(problem.reason) else f"{problem.reason}: {text}")[:300]
