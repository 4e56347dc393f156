"""What a delivery that failed leaves behind, under the lease it held: a retry record and
its backoff, or the final failure and its dead letter (or a failed re-render's record), each
refused when the lease was lost meanwhile; and a re-render requested while one ran, sent
through its lane once more. The job's own path (claim to publish) is jobs.py's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from darkroom import metrics, tracing
from darkroom.errors import DarkroomError
from darkroom.health import declared
from darkroom.queue import policy
from darkroom.queue.lanes import MAX_TENANT_CHARS
from darkroom.queue.messages import DeadLetter, Entry, parse_task, task_fields
from darkroom.queue.streams import Streams
from darkroom.recorder import Recorder
from darkroom.settings import Settings
from darkroom.store import db, failures, history, lanes, leases, upgrading

log = structlog.get_logger("darkroom.jobs")

# The shielded failure record (SQL, then its Redis half) gives up after this long; the
# entry then stays pending and is reclaimed, so a hung dependency cannot hang a stop.
RECORD_DEADLINE_S = 20.0


@dataclass(frozen=True)
class Held:
    """What a failure is recorded under: the lease's token (0: this delivery claimed
    nothing) and the attempt number the dead letter reports."""

    token: int
    attempt: int
    upgrade: bool = False  # the lease is an upgrade's: its failure is an upgrade failure


@dataclass
class Outcomes:
    settings: Settings
    pool: db.Pool
    streams: Streams
    recorder: Recorder

    def _stream(self, entry: Entry) -> Streams:
        """The entry's own lane's stream: its ack, backoff and dead letter happen there."""
        return self.streams.for_lane(entry.lane)

    async def fail(
        self, entry: Entry, held: Held, deliveries: int, exc: DarkroomError, bound: Any
    ) -> DarkroomError | None:
        """Decide (retry later, or the final failure) on the attempt `held` counts, record it
        under its lease, and finish the delivery's history row. Returns the deployment's
        error that kept the record from being written (an outage for the caller to declare),
        else None."""
        decision = policy.decide(
            held.attempt,
            exc,
            max_attempts=self.settings.max_attempts,
            base_ms=self.settings.retry_base_ms,
            cap_ms=self.settings.claim_idle_ms,
        )
        final = isinstance(decision, policy.DeadLetter)
        tracing.note(outcome="failed" if final else "retrying")
        metrics.FAILURES.labels(exc.code, str(final).lower()).inc()
        bound = bound.bind(attempt=held.attempt, deliveries=deliveries, error_code=exc.code,
                           error=str(exc))  # fmt: skip
        # Shielded: the SQL record and its Redis half must not be split by a shutdown;
        # with a deadline, so a hung dependency cannot hold the stop forever.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + RECORD_DEADLINE_S
            outage = await self.record(entry, held, exc, decision, bound)
            ending = history.Ending("failed" if final else "retrying", exc.code, str(exc))
            await self.recorder.end(entry, ending)
        if scope.cancelled_caught:
            bound.error("recording the failure timed out; left pending for reclaim")
        return None if scope.cancelled_caught else outage

    async def record(
        self,
        entry: Entry,
        held: Held,
        exc: DarkroomError,
        decision: policy.Retry | policy.DeadLetter,
        bound: Any,
    ) -> DarkroomError | None:
        try:
            if isinstance(decision, policy.Retry):
                if await self._retry_later(entry, exc, decision.delay_ms, held.token):
                    bound.warning("attempt failed; will retry", delay_ms=decision.delay_ms)
                else:
                    bound.warning("lease_lost", refused="retry")
            elif (ended := await self._dead_letter(entry, held, exc)) == "dead_lettered":
                metrics.OUTCOMES.labels("failed").inc()
                bound.error("photo failed; dead-lettered")
            elif ended in ("rerender_failed", "upgrade_failed"):
                metrics.OUTCOMES.labels("failed").inc()
                bound.error(f"{ended.split('_')[0]} failed; the photo keeps its renditions")
            elif ended == "not_owner":
                bound.warning("lease_lost", refused="failure",
                              note="the entry is left to its owner or to reclaim")  # fmt: skip
            else:
                metrics.OUTCOMES.labels("already").inc()
                bound.warning("photo already finished by another delivery; acked")
        except DarkroomError as follow_up:
            # Nothing is lost: the entry stays pending and is reclaimed after the idle time.
            bound.error("could not record the failure; left pending", cause=str(follow_up))
            # a revoked grant or a schema behind the code: the deployment's, not the photo's
            return follow_up if declared(follow_up) else None
        return None

    async def _retry_later(
        self, entry: Entry, exc: DarkroomError, delay_ms: int, token: int
    ) -> bool:
        """False when the lease was lost meanwhile: the job and its entry are the new
        holder's, and neither is touched (the entry's backoff would take it back)."""
        photo_id = _photo_id(entry)
        if photo_id is not None and token:
            kept = await failures.record_retry(
                self.pool, photo_id, token, exc.code, str(exc), delay_ms
            )
            if not kept:
                return False
        idle_ms = policy.preset_idle_ms(self.settings.claim_idle_ms, delay_ms)
        await self._stream(entry).backoff(entry.id, idle_ms)
        return True

    async def _dead_letter(self, entry: Entry, held: Held, exc: DarkroomError) -> str:
        """Record the final failure, then the dead letter. When the photo is already
        terminal or gone (its one dead letter, if any, exists already) only an ack:
        `already`, or `rerender_failed` when a re-render of a processed photo failed (the
        job records the code; the photo keeps its renditions, the request is answered). When this
        delivery does not hold the job's lease (another process reclaimed the entry, or it
        never claimed), nothing: `not_owner`, the entry stays pending for its owner."""
        photo_id = _photo_id(entry)
        if photo_id is not None:
            record = await failures.record_failure(
                self.pool, photo_id, held.token, entry.id, exc.code, str(exc)
            )
            if record == "not_owner":
                return record
            if record == "finished":
                return await self._finished_failed(entry, photo_id, held, exc)
        if not await self.write_dead_letter(entry, held.attempt, exc.code, str(exc), exc.stage):
            return "not_owner"  # another consumer reclaimed the entry; it writes the letter
        return "dead_lettered"

    async def _finished_failed(
        self, entry: Entry, photo_id: uuid.UUID, held: Held, exc: DarkroomError
    ) -> str:
        """The photo is terminal: the lease holder's failed upgrade (its request dropped)
        or re-render (its request answered) is recorded, the photo keeping its renditions;
        a re-render requested during either goes through again. Then the entry is acked,
        unless a re-render under another lease holds it."""
        failures_of = (failures.record_rerender_failure, upgrading.record_upgrade_failure)
        record = failures_of[held.upgrade]
        failed: str = await record(self.pool, photo_id, held.token, exc.code, str(exc))
        if failed == "not_recorded":
            return await self._not_recorded(entry, photo_id, held.token)
        await self._stream(entry).ack(entry.id)
        if failed == "again":
            await self.again(entry, photo_id)
        return "upgrade_failed" if held.upgrade else "rerender_failed"

    async def _not_recorded(self, entry: Entry, photo_id: uuid.UUID, token: int) -> str:
        if await leases.leave_or_drop(self.pool, photo_id, token, entry.id) == "left":
            return "not_owner"  # the job's new holder acks its entry itself
        await self._stream(entry).ack(entry.id)
        return "already"

    async def write_dead_letter(
        self, entry: Entry, deliveries: int, code: str, message: str, stage: str
    ) -> bool:
        """False if another consumer holds the entry now (no letter written)."""
        photo_id = _photo_id(entry)
        letter = DeadLetter(
            photo_id=str(photo_id or ""),
            source_id=entry.id,
            error_code=code,
            error=message[:1000],
            attempts=deliveries,
            stage=stage,
            consumer=self.streams.consumer,
            lane=entry.lane,
            tenant=entry.fields.get("tenant", "")[:MAX_TENANT_CHARS],
        )
        return bool(await self._stream(entry).dead_letter(entry.id, letter.fields(entry)))

    async def again(self, entry: Entry, photo_id: uuid.UUID, lane: str | None = None) -> None:
        """A re-render requested while this one ran is still to do: once more, through the
        photo's lane (`lane`, as the commit that cleared `enqueued_at` left it; None: read
        now), not the entry's: an operator may have moved the photo during the render, and
        the feeder counts a bulk photo in flight from its `enqueued_at`, which an entry in
        the interactive stream would set. A bulk photo goes back to the feeder; an
        interactive one is XADDed here (the intake finds it should this process die first)."""
        lane = lane or await lanes.lane_of(self.pool, photo_id)
        log.info("re-render requested during the render; enqueued again",
                 photo_id=str(photo_id), lane=lane)  # fmt: skip
        if lane != "interactive":
            return
        fields = task_fields(photo_id, entry.fields)  # the same trace: the photo's
        entry_id = await self.streams.for_lane("interactive").enqueue(fields)
        await db.record_requeued(self.pool, photo_id, entry_id)


def _photo_id(entry: Entry) -> uuid.UUID | None:
    try:
        return parse_task(entry).photo_id
    except DarkroomError:
        return None
