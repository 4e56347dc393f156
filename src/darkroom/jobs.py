"""One stream entry, start to finish: claim → download → render → upload → publish → ack,
or a recorded retry, or a dead letter.

Ordering hazards: the ack comes only after the publishing commit; a final failure is
one SQL statement and then one Redis script (dead letter + ack + delete). Renditions go
to new keys (named by their content) and the renditions a re-render replaced are deleted
only after its commit. A dependency outage is waited out in place (health.Gate), so it
costs the photo no attempt.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog

from darkroom import metrics
from darkroom.errors import (
    ERROR_CODES,
    AttemptsExhaustedError,
    BadMessageError,
    DarkroomError,
    InternalError,
    first_error,
)
from darkroom.health import DEPENDENCIES, Gate
from darkroom.image.pipeline import RenderResult
from darkroom.image.renderer import RenderPool
from darkroom.queue import policy
from darkroom.queue.inflight import InFlight
from darkroom.queue.messages import DeadLetter, Entry, parse_task
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db, keys
from darkroom.store.storage import CONTENT_TYPES, Storage

log = structlog.get_logger("darkroom.jobs")

# A dependency error while the dependency answers its probe (a dropped connection, say)
# is retried in place this many times before it counts as the photo's failure.
IN_PLACE_RETRIES = 2
# The shielded failure record (SQL, then its Redis half) gives up after this long; the
# entry then stays pending and is reclaimed, so a hung dependency cannot hang a stop.
RECORD_DEADLINE_S = 20.0


def sha256_hex(data: bytes) -> str:
    """The original's checksum, of exactly the bytes downloaded (hashlib frees the GIL)."""
    return hashlib.sha256(data).hexdigest()


class LeftPending(Exception):
    """Stopping during an outage: leave the entry pending for whoever comes next."""


@dataclass
class Jobs:
    settings: Settings
    pool: db.Pool
    streams: Streams
    storage: Storage
    gate: Gate
    renderer: RenderPool
    stopping: anyio.Event
    # The worker's in-flight entries (their owner); an entry is settled before its
    # backoff is set, so a late heartbeat cannot cancel the delay.
    in_flight: InFlight

    async def handle(self, entry: Entry, deliveries: int) -> None:
        started = time.monotonic()
        bound = log.bind(entry_id=entry.id, photo_id=_logged_photo_id(entry), attempt=deliveries)
        try:
            outcome = await self._resilient(entry, deliveries)
            metrics.OUTCOMES.labels(outcome).inc()
            bound.info("entry done", outcome=outcome, seconds=round(time.monotonic() - started, 3))
        except LeftPending:
            bound.warning("stopping during an outage; entry left pending")
        except DarkroomError as exc:
            await self._fail(entry, deliveries, exc, bound)
        except Exception as exc:
            bound.exception("unexpected error")
            error = InternalError(f"{type(exc).__name__}: {exc}")
            await self._fail(entry, deliveries, error, bound)

    async def _resilient(self, entry: Entry, deliveries: int) -> str:
        """Process and ack; dependency errors are retried in place, outages waited out."""
        retries = 0
        claims: dict[str, db.Claim] = {}  # one claim per delivery, however often retried
        outcome = None  # once committed, only the ack is retried
        while True:
            try:
                outcome = outcome or await self._process(entry, deliveries, claims)
                await self.streams.ack(entry.id)
                return outcome
            except DarkroomError as exc:
                if exc.stage not in DEPENDENCIES or not exc.retryable:
                    raise
                # An outage is waited out; a dependency that answers its probe gets a
                # few retries in place, each after a pause (never back to back).
                if not await self.gate.wait(exc.stage):
                    retries += 1
                    if retries > IN_PLACE_RETRIES:
                        raise
                    await anyio.sleep(0.25 * 2**retries)
                if self.stopping.is_set():
                    raise LeftPending from exc

    async def _process(self, entry: Entry, deliveries: int, claims: dict[str, db.Claim]) -> str:
        # The cap comes first, whatever the entry holds: nothing about its content may
        # keep an entry delivered past the cap from being given up.
        if deliveries > self.settings.max_attempts:
            await self._given_up(entry, deliveries, claims)
        task = parse_task(entry)
        claim = claims.get(entry.id) or await db.claim(
            self.pool, task.photo_id, entry.id, self.streams.consumer
        )
        claims[entry.id] = claim
        if claim.outcome == "already" and claim.state == "processing_failed":
            return await self._finish_failure(entry, deliveries, claim)
        if claim.outcome != "claimed":
            return claim.outcome
        with metrics.STAGE_SECONDS.labels("download").time():
            original = await self.storage.get(claim.original_key, self.settings.max_original_bytes)
        with metrics.STAGE_SECONDS.labels("render").time():
            result = await self.renderer.render(original, self.settings.renditions)
        metrics.RENDER_PEAK_RSS_MB.observe(result.peak_rss_mb)
        with metrics.STAGE_SECONDS.labels("upload").time():
            renditions = await self._upload(task.photo_id, result)
        facts = result.facts.row(len(original), keep_location=self.settings.keep_location)
        facts["original_sha256"] = await anyio.to_thread.run_sync(sha256_hex, original)
        with metrics.STAGE_SECONDS.labels("publish").time():
            replaced = await db.publish(
                self.pool, task.photo_id, facts, msgspec.json.encode(renditions).decode()
            )
        if replaced is None:
            return "already"
        current = [r["key"] for r in renditions]
        await self._delete_superseded(task.photo_id, keys.superseded(replaced, current))
        return "published"

    async def _given_up(self, entry: Entry, deliveries: int, claims: dict[str, db.Claim]) -> None:
        """Past the cap: a malformed entry names no photo to ask about, so it is given up
        at once (parse_task is pure and raises only BadMessageError); a well-formed one
        goes to `_past_the_cap`."""
        try:
            photo_id = parse_task(entry).photo_id
        except BadMessageError as exc:
            message = f"delivered {deliveries} times without finishing; {exc}"
            raise AttemptsExhaustedError(message) from exc
        await self._past_the_cap(entry, photo_id, deliveries, claims)

    async def _past_the_cap(
        self, entry: Entry, photo_id: uuid.UUID, deliveries: int, claims: dict[str, db.Claim]
    ) -> None:
        """Checked before any work, so a photo that kills its worker cannot loop. A photo
        that is gone or already terminal goes on to the claim, which changes nothing."""
        state = await db.photo_state(self.pool, photo_id)
        if state == "processed":  # a re-render that keeps failing is given up, never looped
            await db.drop_rerender(self.pool, photo_id)
        if state in (None, "processed", "processing_failed"):
            return
        code, message = await db.last_error(self.pool, photo_id)
        # The job is taken first: only the delivery that owns it may record its failure
        # (its last owner is the worker that died).
        claim = claims.get(entry.id) or await db.claim(
            self.pool, photo_id, entry.id, self.streams.consumer
        )
        claims[entry.id] = claim
        if claim.outcome != "claimed":
            return  # finished meanwhile: the claim's outcome says how
        raise AttemptsExhaustedError(
            f"delivered {deliveries} times without finishing; last error: "
            f"{code or 'none recorded (the worker died)'} {message or ''}".strip()
        )

    async def _finish_failure(self, entry: Entry, deliveries: int, claim: db.Claim) -> str:
        """The failure of this very entry was committed but its dead letter never written
        (Redis failed, or the worker died in between): write it now. A duplicate entry of
        a failed photo is just acked."""
        if claim.last_entry != entry.id:
            return "already"
        code = claim.error_code or "internal_error"
        stage = ERROR_CODES[code].stage if code in ERROR_CODES else "process"
        await self._write_dead_letter(entry, deliveries, code, claim.last_error or "", stage)
        return "failed"

    async def _upload(self, photo_id: uuid.UUID, result: RenderResult) -> list[dict[str, Any]]:
        """Each rendition under a new key named by its content, beside the live ones: a
        half-done upload changes nothing a reader sees (the row still names the old keys)."""
        described: list[dict[str, Any]] = []
        try:
            async with anyio.create_task_group() as uploads:
                for r in result.renditions:
                    key = keys.rendition_key(photo_id, r.name, r.ext, r.sha256)
                    uploads.start_soon(self.storage.put, key, r.data, CONTENT_TYPES[r.format],
                                       self.settings.cache_control)  # fmt: skip
                    described.append(
                        {"name": r.name, "format": r.format, "key": key, "width": r.width,
                         "height": r.height, "bytes": len(r.data)}
                    )  # fmt: skip
        except ExceptionGroup as group:
            raise first_error(group) from group
        return described

    async def _delete_superseded(self, photo_id: uuid.UUID, candidates: list[str]) -> None:
        """After the commit, best effort: the photo is published, so a failure here only
        leaves objects for `darkroom gc` (never an error for the photo). Under the photo's
        row lock: no other delivery can claim it and commit these keys meanwhile."""
        if not candidates:
            return
        try:
            async with db.hold_photo(self.pool, photo_id) as held:
                for key in keys.deletable(candidates, held):
                    await self.storage.delete(key)
        except DarkroomError as exc:
            log.warning("superseded renditions left for darkroom gc", photo_id=str(photo_id),
                        keys=candidates, error_code=exc.code, error=str(exc))  # fmt: skip

    async def _fail(self, entry: Entry, deliveries: int, exc: DarkroomError, bound: Any) -> None:
        decision = policy.decide(
            deliveries,
            exc,
            max_attempts=self.settings.max_attempts,
            base_ms=self.settings.retry_base_ms,
            cap_ms=self.settings.claim_idle_ms,
        )
        final = isinstance(decision, policy.DeadLetter)
        self.in_flight.settle(entry.id)
        metrics.FAILURES.labels(exc.code, str(final).lower()).inc()
        bound = bound.bind(error_code=exc.code, error=str(exc))
        # Shielded: the SQL record and its Redis half must not be split by a shutdown;
        # with a deadline, so a hung dependency cannot hold the stop forever.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + RECORD_DEADLINE_S
            await self._record(entry, deliveries, exc, decision, bound)
        if scope.cancelled_caught:
            bound.error("recording the failure timed out; left pending for reclaim")

    async def _record(
        self,
        entry: Entry,
        deliveries: int,
        exc: DarkroomError,
        decision: policy.Retry | policy.DeadLetter,
        bound: Any,
    ) -> None:
        try:
            if isinstance(decision, policy.Retry):
                await self._retry_later(entry, exc, decision.delay_ms)
                bound.warning("attempt failed; will retry", delay_ms=decision.delay_ms)
            elif (ended := await self._dead_letter(entry, deliveries, exc)) == "dead_lettered":
                metrics.OUTCOMES.labels("failed").inc()
                bound.error("photo failed; dead-lettered")
            elif ended == "rerender_failed":
                metrics.OUTCOMES.labels("failed").inc()
                bound.error("re-render failed; the photo keeps its renditions")
            elif ended == "not_owner":
                bound.warning("failure not recorded: this delivery does not own the job; "
                              "the entry is left to its owner or to reclaim")  # fmt: skip
            else:
                metrics.OUTCOMES.labels("already").inc()
                bound.warning("photo already finished by another delivery; acked")
        except DarkroomError as follow_up:
            # Nothing is lost: the entry stays pending and is reclaimed after the idle time.
            bound.error("could not record the failure; left pending", cause=str(follow_up))

    async def _retry_later(self, entry: Entry, exc: DarkroomError, delay_ms: int) -> None:
        photo_id = _photo_id(entry)
        if photo_id is not None:
            await db.record_retry(self.pool, photo_id, entry.id, exc.code, str(exc), delay_ms)
        idle_ms = policy.preset_idle_ms(self.settings.claim_idle_ms, delay_ms)
        await self.streams.backoff(entry.id, idle_ms)

    async def _dead_letter(self, entry: Entry, deliveries: int, exc: DarkroomError) -> str:
        """Record the final failure, then the dead letter. When the photo is already
        terminal or gone (its one dead letter, if any, exists already) only an ack:
        `already`, or `rerender_failed` when a re-render of a processed photo failed (the
        job records the code; the photo stays as it was, with its request set). When this
        delivery does not own the job (another consumer reclaimed the entry, or it never
        claimed), nothing: `not_owner`, the entry stays pending for its owner."""
        photo_id, consumer = _photo_id(entry), self.streams.consumer
        if photo_id is not None:
            record = await db.record_failure(
                self.pool, photo_id, entry.id, consumer, exc.code, str(exc)
            )
            if record == "not_owner":
                return record
            if record == "finished":
                rerender = await db.record_rerender_failure(
                    self.pool, photo_id, entry.id, consumer, exc.code, str(exc)
                )
                await self.streams.ack(entry.id)
                return "rerender_failed" if rerender else "already"
        await self._write_dead_letter(entry, deliveries, exc.code, str(exc), exc.stage)
        return "dead_lettered"

    async def _write_dead_letter(
        self, entry: Entry, deliveries: int, code: str, message: str, stage: str
    ) -> None:
        photo_id = _photo_id(entry)
        letter = DeadLetter(
            photo_id=str(photo_id or ""),
            source_id=entry.id,
            error_code=code,
            error=message[:1000],
            attempts=deliveries,
            stage=stage,
            consumer=self.streams.consumer,
        )
        await self.streams.dead_letter(entry.id, letter.fields(entry))


def _logged_photo_id(entry: Entry) -> str | None:
    """For the log line: the field as text (escaped), cut short, whatever was sent."""
    shown = entry.fields.get("photo_id")
    return None if shown is None else shown[:80]


def _photo_id(entry: Entry) -> uuid.UUID | None:
    try:
        return parse_task(entry).photo_id
    except DarkroomError:
        return None
