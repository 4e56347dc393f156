"""Dependency health: tells a dependency outage from a photo's own failure.

When Redis, PostgreSQL or storage fails, a cheap probe decides. If the probe fails too,
it is an outage: the dependency is marked down, intake stops taking new work, and the
photos caught in it wait (keeping their slots and their delivery) until the probe passes
again, reconnecting with capped exponential backoff. So an outage never burns attempts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import structlog

from darkroom import metrics
from darkroom.errors import DarkroomError

log = structlog.get_logger("darkroom.health")

Probe = Callable[[], Awaitable[None]]
# Error stages that name a dependency (errors.py): storage, database, queue.
DEPENDENCIES = ("storage", "database", "queue")


class Gate:
    def __init__(
        self, probes: dict[str, Probe], stopping: anyio.Event, max_backoff_s: float = 10.0
    ) -> None:
        self.probes, self.stopping = probes, stopping
        self.down: set[str] = set()
        self.max_backoff_s = max_backoff_s
        self._recovered = anyio.Event()

    def is_open(self) -> bool:
        return not self.down

    async def healthy(self, dependency: str) -> bool:
        try:
            with anyio.fail_after(10):
                await self.probes[dependency]()
            return True
        except (DarkroomError, TimeoutError):
            return False

    async def wait(self, dependency: str) -> None:
        """Return once `dependency` answers again, or the worker is stopping; one task
        probes, the others wait."""
        if dependency in self.down:
            while dependency in self.down and not self.stopping.is_set():
                with anyio.move_on_after(1):
                    await self._recovered.wait()
            return
        self.down.add(dependency)
        metrics.OUTAGES.labels(dependency).inc()
        log.warning("dependency down: pausing intake", dependency=dependency)
        delay_s, started = 0.25, anyio.current_time()
        try:
            while not await self.healthy(dependency):
                with anyio.move_on_after(delay_s):
                    await self.stopping.wait()
                if self.stopping.is_set():
                    return
                delay_s = min(delay_s * 2, self.max_backoff_s)
        finally:
            self.down.discard(dependency)
            self._recovered.set()
            self._recovered = anyio.Event()
        seconds = round(anyio.current_time() - started, 3)
        log.info("dependency back: resuming", dependency=dependency, seconds=seconds)
