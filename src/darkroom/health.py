"""Dependency health: tells a dependency outage from a photo's own failure.

When Redis, PostgreSQL or storage fails, a probe that exercises what the worker needs (a
write, not a ping) decides. If it fails too, it is an outage: the dependency is marked
down with its reason (/readyz shows it), intake stops taking new work, and the photos
caught in it wait (keeping their slots and their delivery). One task probes, with capped
exponential backoff and a reconnect between probes; the others wait for it. So an outage
never burns attempts, and never spins. An error that is the deployment's (a grant, the
schema) is declared an outage whatever the probe says, and held until the probe passes.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
# Dependencies whose permanent errors are the deployment's, never a photo's: everything a
# photo brings to PostgreSQL is a parameter, so a refused grant or a missing table, column
# or function says the role or the schema is wrong. (Storage and Redis may refuse one
# object or key for the photo's own reason: their probe decides.)
DECLARED_BY = frozenset({"database"})
PROBE_TIMEOUT_S = 10.0
# An outage is logged when it starts, then at most once a minute until it ends.
STILL_DOWN_EVERY_S = 60.0
# An outage that starts again this soon after one of the same reason ended is the same
# spell: a failure the probe cannot see comes back at once, and must not log or count anew.
SAME_SPELL_S = 60.0


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


def declared(exc: DarkroomError) -> bool:
    """The deployment's fault whatever the probe says: an outage, never an attempt."""
    return exc.stage in DECLARED_BY and not exc.transient


@dataclass
class Spell:
    """One outage of a dependency as the logs and a drain see it, across restarts of the
    same reason within SAME_SPELL_S (the backoff and the log throttle go on)."""

    problem: DarkroomError
    started_s: float
    backoff: Backoff
    throttle: Throttle = field(default_factory=lambda: Throttle(STILL_DOWN_EVERY_S))
    ended_s: float | None = None


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
        self.spells: dict[str, Spell] = {}  # dependency → its last outage
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

    def lasting(self, at_least_s: float) -> str | None:
        """The outage under way for at least `at_least_s`, as /readyz says it (a drain ends
        on it), if any."""
        now_s = self.clock.now()
        for dependency, spell in self.spells.items():
            if dependency in self.down and now_s - spell.started_s >= at_least_s:
                return f"{dependency} down for {now_s - spell.started_s:.0f} s: " + (
                    self.down.get(dependency) or _describe(spell.problem)
                )
        return None

    async def wait(self, dependency: str, declared: DarkroomError | None = None) -> bool:
        """Return once `dependency` passes its probe, or the worker is stopping. True if it
        was down (an outage was waited out), False if the first probe passed. `declared`:
        an error that makes it an outage even when the probe passes (held until a probe
        after it passes)."""
        if dependency not in self.down:
            problem = await self.check(dependency) or declared
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
        spell, said = self._spell(dependency, first)
        started, probes = spell.started_s, 1
        try:
            while problem is not None:
                await self.clock.sleep(spell.backoff.next_s(), self.stopping)
                if self.stopping.is_set():
                    return
                await self._reconnect(dependency)
                problem, probes = await self.check(dependency), probes + 1
                if problem is not None:
                    self.down[dependency], spell.problem = _describe(problem), problem
                    self._still_down(dependency, problem, probes, spell.throttle)
        finally:
            spell.ended_s = self.clock.now()
            self.down.pop(dependency, None)
            self._recovered.set()
            self._recovered = anyio.Event()
        if said:  # a spell that went on quietly ends quietly
            seconds = round(self.clock.now() - started, 3)
            log.info("dependency back: resuming", dependency=dependency, seconds=seconds,
                     probes=probes)  # fmt: skip

    def _spell(self, dependency: str, first: DarkroomError) -> tuple[Spell, bool]:
        """A new spell (counted, logged; True), or the last one going on: same reason, ended
        less than SAME_SPELL_S ago (said once a minute as still down; its end unsaid)."""
        now_s, last = self.clock.now(), self.spells.get(dependency)
        going_on = (
            last is not None and last.ended_s is not None
            and last.problem.reason == first.reason and now_s - last.ended_s < SAME_SPELL_S
        )  # fmt: skip
        if last is None or not going_on:
            last = Spell(first, now_s, Backoff(0.25, self.max_backoff_s, self.rand))
            self.spells[dependency] = last
            metrics.OUTAGES.labels(dependency).inc()
        last.problem, last.ended_s = first, None
        quiet = last.throttle.allow(first.reason, now_s)
        if going_on:
            if quiet is not None:
                log.warning("dependency still down", dependency=dependency, reason=first.reason,
                            error=str(first), repeats_not_logged=quiet)  # fmt: skip
            return last, False
        log.warning("dependency down: pausing intake", dependency=dependency,
                    reason=first.reason, error=str(first))  # fmt: skip
        return last, True

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
