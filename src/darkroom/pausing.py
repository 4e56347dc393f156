"""Each worker's copy of the pauses (queue_pauses in PostgreSQL, the truth): re-read every
POLL_S, so every replica stops reading a paused lane, and its feeder feeding a paused
tenant, within a second of the pause's commit. The claim reads the table itself
(leases.CLAIM_SQL), so a copy a moment old never lets a paused photo start. A watch that
reads a timed pause past its time ends it (its `resumed` event): of many replicas, one does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import structlog

from darkroom.errors import DarkroomError
from darkroom.queue.pacing import Throttle
from darkroom.queue.pauses import Paused
from darkroom.store import db, pauses

log = structlog.get_logger("darkroom.pausing")

# One indexed read of a table of a few rows per replica and period: the whole cost of
# learning within a second (docs/operations.md says why no LISTEN).
POLL_S = 0.5
REPEAT_LOG_EVERY_S = 10.0


@dataclass
class PauseWatch:
    pool: db.Pool
    heard: Callable[[Paused], None]  # called on each change, with the pauses now in force
    paused: Paused = field(default_factory=Paused)
    _throttle: Throttle = field(default_factory=lambda: Throttle(REPEAT_LOG_EVERY_S))
    # its own: a read that works clears the read's throttle, and an expiry failing every
    # look (say, a schema behind the code) would then be logged every POLL_S
    _expire_throttle: Throttle = field(default_factory=lambda: Throttle(REPEAT_LOG_EVERY_S))

    async def run(self) -> None:
        while True:
            await self.look()
            await anyio.sleep(POLL_S)

    async def look(self) -> None:
        """Read the pauses once; while the database fails, the last copy stands (the
        claim refuses a paused photo whatever this copy says)."""
        try:
            active, ran_out = await pauses.watched(self.pool)
        except DarkroomError as exc:
            self._failed("reading the pauses failed", exc, self._throttle)
            return
        self._throttle.clear()
        self._compare(Paused.of(active))
        if ran_out:
            await self._expire()

    def _compare(self, now: Paused) -> None:
        if now != self.paused:
            self.paused = now
            scopes = sorted(f"{p.lane or '*'}/{'*' if p.tenant is None else p.tenant}"
                            for p in now.pauses)  # fmt: skip
            log.info("pauses changed", paused=scopes)
            self.heard(now)

    async def _expire(self) -> None:
        """End the timed pauses past their time; a failure leaves them to the next look
        (they hold nothing meanwhile: every reader compares `until` with now())."""
        try:
            ended = await pauses.expire(self.pool)
        except DarkroomError as exc:
            self._failed("ending a timed pause failed", exc, self._expire_throttle)
            return
        self._expire_throttle.clear()
        for row in ended:
            log.info("timed pause ran out", lane=row["lane"], tenant=row["tenant"],
                     until=row["until"].isoformat())  # fmt: skip

    @staticmethod
    def _failed(what: str, exc: DarkroomError, throttle: Throttle) -> None:
        if throttle.allow(exc.code, anyio.current_time()) is not None:
            log.warning(what, error_code=exc.code, error=str(exc))
