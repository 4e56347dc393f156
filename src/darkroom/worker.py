"""Orchestration: intake (own pending, reclaim, new reads) into free slots, one task per
entry, heartbeat of in-flight entries, graceful stop. The only module that creates
task groups.

Ordering hazards: ack only after the Postgres commit; never read more entries than there
are free slots; stop between reads, never cancel a read in flight.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup

from darkroom import db, metrics, policy
from darkroom.errors import AttemptsExhaustedError, DarkroomError, InternalError
from darkroom.messages import DeadLetter, Entry, parse_task
from darkroom.pipeline import RenderResult
from darkroom.renderer import render_isolated
from darkroom.settings import Settings
from darkroom.storage import CONTENT_TYPES, Storage
from darkroom.streams import Streams

log = structlog.get_logger("darkroom.worker")

RECLAIM_EVERY_S = 0.5


def rendition_key(photo_id: uuid.UUID, name: str, ext: str) -> str:
    return f"renditions/{photo_id}/{name}.{ext}"


@dataclass
class Worker:
    settings: Settings
    pool: db.Pool
    streams: Streams
    storage: Storage
    stopping: anyio.Event = field(default_factory=anyio.Event)
    in_flight: set[str] = field(default_factory=set)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.limiter = anyio.CapacityLimiter(self.settings.concurrency)

    def stop(self) -> None:
        """First signal: stop reading; in-flight photos finish within the grace period."""
        self.stopping.set()
        self._notify()

    def ready(self) -> bool:
        return not self.stopping.is_set()

    async def run(self, *, drain: bool = False) -> None:
        await self.streams.ensure_group()
        async with anyio.create_task_group() as services:
            services.start_soon(self._heartbeat_loop)
            async with anyio.create_task_group() as jobs:
                await self._intake(jobs, drain)
                with anyio.move_on_after(self.settings.shutdown_grace_s):
                    await self._wait(lambda: not self.in_flight)
                if self.in_flight:
                    log.warning("grace period over; left pending", entries=sorted(self.in_flight))
                jobs.cancel_scope.cancel()
            services.cancel_scope.cancel()

    # -- intake ---------------------------------------------------------------------------

    def _free(self) -> int:
        return self.settings.concurrency - len(self.in_flight)

    async def _intake(self, jobs: TaskGroup, drain: bool) -> None:
        await self._dispatch(jobs, await self.streams.read_own_pending(self._free()), fresh=False)
        next_reclaim = 0.0
        while not self.stopping.is_set():
            await self._wait(lambda: self._free() > 0 or self.stopping.is_set())
            if self.stopping.is_set():
                return
            if time.monotonic() >= next_reclaim:
                await self._reclaim(jobs)
                next_reclaim = time.monotonic() + RECLAIM_EVERY_S
                if self._free() == 0:
                    continue
            entries = await self.streams.read_new(self._free(), self._block_ms(drain))
            await self._dispatch(jobs, entries, fresh=True)
            if drain and not entries and await self._drained():
                return

    def _block_ms(self, drain: bool) -> int:
        # While retries wait in the PEL, poll often enough to reclaim them on time.
        return min(self.settings.read_block_ms, 500) if drain else self.settings.read_block_ms

    async def _drained(self) -> bool:
        return not self.in_flight and await self.streams.pending_count() == 0

    async def _reclaim(self, jobs: TaskGroup) -> None:
        before = self.streams.deleted_while_pending
        entries = await self.streams.reclaim(self.settings.claim_idle_ms, self._free())
        if lost := self.streams.deleted_while_pending - before:
            metrics.DELETED_WHILE_PENDING.inc(lost)
            log.warning("pending entries were deleted from the stream", count=lost)
        metrics.RECLAIMED.inc(len(entries))
        await self._dispatch(jobs, entries, fresh=False)

    async def _dispatch(self, jobs: TaskGroup, entries: list[Entry], *, fresh: bool) -> None:
        for entry in entries:
            deliveries = 1 if fresh else await self.streams.deliveries(entry.id)
            self.in_flight.add(entry.id)
            metrics.IN_FLIGHT.set(len(self.in_flight))
            jobs.start_soon(self._handle, entry, deliveries)

    async def _wait(self, condition: object) -> None:
        assert callable(condition)
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _heartbeat_loop(self) -> None:
        period_s = min(self.settings.claim_idle_ms / 3000, 10.0)
        while True:
            await anyio.sleep(period_s)
            try:
                await self.streams.heartbeat(sorted(self.in_flight))
            except DarkroomError as exc:
                log.warning("heartbeat failed", error=str(exc))

    # -- one entry ------------------------------------------------------------------------

    async def _handle(self, entry: Entry, deliveries: int) -> None:
        started = time.monotonic()
        bound = log.bind(
            entry_id=entry.id, photo_id=entry.fields.get("photo_id"), attempt=deliveries
        )
        try:
            outcome = await self._process(entry, deliveries)
            await self.streams.ack(entry.id)
            metrics.OUTCOMES.labels(outcome).inc()
            bound.info("entry done", outcome=outcome, seconds=round(time.monotonic() - started, 3))
        except DarkroomError as exc:
            await self._fail(entry, deliveries, exc, bound)
        except Exception as exc:
            bound.exception("unexpected error")
            await self._fail(
                entry, deliveries, InternalError(f"{type(exc).__name__}: {exc}"), bound
            )
        finally:
            self.in_flight.discard(entry.id)
            metrics.IN_FLIGHT.set(len(self.in_flight))
            self._notify()

    async def _process(self, entry: Entry, deliveries: int) -> str:
        task = parse_task(entry)
        if deliveries > self.settings.max_attempts:
            code, message = await db.last_error(self.pool, task.photo_id)
            raise AttemptsExhaustedError(
                f"delivered {deliveries} times without finishing; last error: "
                f"{code or 'none recorded (the worker died)'} {message or ''}".strip()
            )
        claim = await db.claim(self.pool, task.photo_id, entry.id, self.streams.consumer)
        if claim.outcome != "claimed":
            return claim.outcome
        with _timed("download"):
            original = await self.storage.get(claim.original_key, self.settings.max_original_bytes)
        with _timed("render"):
            result = await render_isolated(
                original,
                self.settings.renditions,
                max_pixels=self.settings.max_pixels,
                timeout_s=self.settings.job_timeout_s,
                memory_mb=self.settings.render_memory_mb,
                limiter=self.limiter,
            )
        metrics.RENDER_PEAK_RSS_MB.observe(result.peak_rss_mb)
        with _timed("upload"):
            renditions = await self._upload(task.photo_id, result)
        facts = {**msgspec.structs.asdict(result.facts), "bytes": len(original)}
        with _timed("publish"):
            published = await db.publish(self.pool, task.photo_id, facts, renditions)
        return "published" if published else "already"

    async def _upload(self, photo_id: uuid.UUID, result: RenderResult) -> str:
        described = []
        async with anyio.create_task_group() as uploads:
            for r in result.renditions:
                key = rendition_key(photo_id, r.name, r.ext)
                uploads.start_soon(self.storage.put, key, r.data, CONTENT_TYPES[r.format])
                described.append(
                    {"name": r.name, "format": r.format, "key": key, "width": r.width,
                     "height": r.height, "bytes": len(r.data)}
                )  # fmt: skip
        return msgspec.json.encode(described).decode()

    async def _fail(self, entry: Entry, deliveries: int, exc: DarkroomError, bound: object) -> None:
        decision = policy.decide(
            deliveries,
            exc,
            max_attempts=self.settings.max_attempts,
            base_ms=self.settings.retry_base_ms,
            cap_ms=self.settings.claim_idle_ms,
        )
        final = isinstance(decision, policy.DeadLetter)
        metrics.FAILURES.labels(exc.code, str(final).lower()).inc()
        logger = log.bind(entry_id=entry.id, photo_id=entry.fields.get("photo_id"),
                          attempt=deliveries, error_code=exc.code)  # fmt: skip
        try:
            if isinstance(decision, policy.Retry):
                await self._retry_later(entry, exc, decision.delay_ms)
                logger.warning(
                    "attempt failed; will retry", error=str(exc), delay_ms=decision.delay_ms
                )
            else:
                await self._dead_letter(entry, deliveries, exc)
                metrics.OUTCOMES.labels("failed").inc()
                logger.error("photo failed; dead-lettered", error=str(exc))
        except DarkroomError as follow_up:
            # Nothing is lost: the entry stays pending and is reclaimed after the idle time.
            logger.error("could not record the failure; left pending", error=str(follow_up))

    async def _retry_later(self, entry: Entry, exc: DarkroomError, delay_ms: int) -> None:
        photo_id = _photo_id(entry)
        if photo_id is not None:
            await db.record_retry(self.pool, photo_id, exc.code, str(exc), delay_ms)
        idle_ms = policy.preset_idle_ms(self.settings.claim_idle_ms, delay_ms)
        await self.streams.backoff(entry.id, idle_ms)

    async def _dead_letter(self, entry: Entry, deliveries: int, exc: DarkroomError) -> None:
        photo_id = _photo_id(entry)
        if photo_id is not None:
            await db.record_failure(self.pool, photo_id, exc.code, str(exc))
        letter = DeadLetter(
            photo_id=str(photo_id or ""),
            source_id=entry.id,
            error_code=exc.code,
            error=str(exc)[:1000],
            attempts=deliveries,
            stage=exc.stage,
            consumer=self.streams.consumer,
        )
        await self.streams.dead_letter(entry.id, letter.fields(entry.fields))


def _photo_id(entry: Entry) -> uuid.UUID | None:
    try:
        return parse_task(entry).photo_id
    except DarkroomError:
        return None


class _timed:
    def __init__(self, stage: str) -> None:
        self.stage = stage

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        metrics.STAGE_SECONDS.labels(self.stage).observe(time.monotonic() - self.started)
