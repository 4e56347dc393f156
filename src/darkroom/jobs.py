"""One stream entry, start to finish: claim → download → render → upload → publish → ack,
or a recorded retry, or a dead letter.

Ordering hazards: the ack comes only after the publishing commit; a final failure is
one SQL statement and then one Redis script (dead letter + ack + delete). Attempts are
counted in PostgreSQL by the claim; a dependency outage (health.Gate) and a transient
error are waited out in place (waits.py, mixed in), so neither costs the photo an
attempt, and a job whose owner lives is left to it. Renditions go to new keys (named by
their content) and the renditions a re-render replaced are deleted only after its commit.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog

from darkroom import metrics, spanwriter, tracing, upgrades
from darkroom.errors import (
    ERROR_CODES,
    AttemptsExhaustedError,
    BadMessageError,
    DarkroomError,
    InternalError,
)
from darkroom.health import Gate
from darkroom.image.renderer import RenderPool
from darkroom.outcomes import Held, Outcomes
from darkroom.queue import policy
from darkroom.queue.inflight import InFlight
from darkroom.queue.messages import Entry, Task, enqueued_ms, parse_task
from darkroom.queue.streams import Streams
from darkroom.recorder import Recorder
from darkroom.settings import Settings
from darkroom.store import db, history, keys, leases, publishing
from darkroom.store.storage import Storage
from darkroom.upgrades import Upgrades
from darkroom.uploads import Renditions
from darkroom.waits import LeftPending, WaitsInPlace

log = structlog.get_logger("darkroom.jobs")


@dataclass
class Jobs(WaitsInPlace):
    settings: Settings
    pool: db.Pool
    streams: Streams
    storage: Storage
    gate: Gate
    renderer: RenderPool
    stopping: anyio.Event
    # The worker's in-flight entries (their owner) and what each claimed; an entry is
    # settled before its backoff is set, so a late heartbeat cannot cancel the delay.
    in_flight: InFlight[leases.Claim]
    # This process, as the holder of the jobs it claims (a consumer name may be reused by
    # the next process; this never is).
    holder: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.lease = leases.Lease(
            self.holder, policy.lease_ms(self.settings.claim_idle_ms), self.settings.max_attempts
        )
        self.recorder = Recorder(self.pool, self.streams.consumer, self.settings.history)
        self.outcomes = Outcomes(self.settings, self.pool, self.streams, self.recorder)
        self.named_tenants = frozenset(dict(self.settings.tenant_weights))
        self.upgrades = Upgrades(self.pool, self.streams, self.recorder)
        self.renditions = Renditions(self.pool, self.storage, self.settings.cache_control)
        metrics.watch_render_budget(self.renderer.budget)

    def _stream(self, entry: Entry) -> Streams:
        """The entry's own lane's stream: its ack, backoff and dead letter happen there."""
        return self.streams.for_lane(entry.lane)

    async def handle(self, entry: Entry, deliveries: int) -> None:
        """One delivery, in its own `darkroom.process` span (docs/tracing.md)."""
        with tracing.delivery(entry, deliveries, self._stream(entry).stream, self.streams.group):
            await self._handle(entry, deliveries)

    async def _handle(self, entry: Entry, deliveries: int) -> None:
        started = time.monotonic()
        bound = log.bind(entry_id=entry.id, photo_id=_logged_photo_id(entry), deliveries=deliveries)
        try:
            outcome = await self._resilient(entry, deliveries)
            tracing.note(outcome=outcome)
            metrics.OUTCOMES.labels(outcome).inc()
            if outcome != "paused":  # no attempt, and no history row per look while paused
                await self.recorder.end(entry, history.Ending(outcome))
            bound.info("entry done", outcome=outcome, seconds=round(time.monotonic() - started, 3))
        except LeftPending as left:
            tracing.note(outcome="left_pending")
            bound.warning(str(left))
        except DarkroomError as exc:
            await self._fail(entry, deliveries, exc, bound)
        except Exception as exc:
            bound.exception("unexpected error")
            error = InternalError(f"{type(exc).__name__}: {exc}")
            await self._fail(entry, deliveries, error, bound)
        finally:
            self.recorder.forget(entry)

    async def _process(self, entry: Entry, deliveries: int) -> str:
        # The backstop comes first, whatever the entry holds: nothing about its content may
        # keep an entry delivered past it from being given up.
        if policy.past_backstop(deliveries, self.settings.max_attempts):
            _give_up_if_malformed(entry, deliveries)
        task = parse_task(entry)
        # Once a claim succeeds, PostgreSQL's count rules: a duplicate entry that stepped
        # aside many times while its photo's owner lived has a high delivery count and
        # nothing wrong with it.
        claim = await self._claim(entry, task)
        if claim.outcome != "claimed":
            return await self._unclaimed(entry, deliveries, claim)
        with self.recorder.timed(entry, "download"):
            original = await self.storage.get(claim.original_key, self.settings.max_original_bytes)
        specs, deferred = upgrades.specs_for(self.settings, entry.lane, claim.upgrade)
        with self.recorder.timed(entry, "render"):
            result = await self.renderer.render(
                original, specs, interactive=entry.lane == "interactive",
                started=_wait_observer(entry, deliveries),
                time_stages=tracing.recording(),
            )  # fmt: skip
            tracing.rendered(result.stages)
        metrics.observe(metrics.RENDER_PEAK_RSS_MB, result.peak_rss_mb)
        self.recorder.attempt(entry).peak_rss_mb = result.peak_rss_mb
        with self.recorder.timed(entry, "upload"):
            renditions = await self.renditions.upload(task.photo_id, result)
        if claim.upgrade:
            with self.recorder.timed(entry, "publish"):
                done = self.renditions.delete_unreferenced, self.outcomes.again
                return await self.upgrades.publish(entry, claim, renditions, *done)
        facts = result.facts.row(len(original), keep_location=self.settings.keep_location)
        current = [r["key"] for r in renditions]
        # recorded before the publish: a try whose publish reply is lost never gets past it
        tried = self.in_flight.uploaded(entry.id, current)  # this delivery's tries, all
        with self.recorder.timed(entry, "publish"):
            published = await publishing.publish(
                self.pool, task.photo_id, facts, msgspec.json.encode(renditions).decode(),
                (claim.token, entry.id), self.recorder.publishing(entry), deferred,
            )  # fmt: skip
        if published.status != "published":
            if published.status != "lost":  # lost: a newer lease renders, maybe these keys
                await self.renditions.delete_unreferenced(task.photo_id, tried, "refused uploads")
            if published.status == "already" and deferred:  # maybe ours, its reply lost
                await self.upgrades.request(entry, task.photo_id)  # a spare one is `already`
            return _refused(entry, claim, published.status)
        self.recorder.published(entry)
        if "tenant" in entry.fields:  # a bulk entry (the feeder's)
            pixels = int(facts.get("width") or 0) * int(facts.get("height") or 0)
            metrics.count_tenant_done(entry.fields["tenant"], pixels, self.named_tenants)
        replaced = keys.superseded(published.replaced, current)
        await self.renditions.delete_unreferenced(task.photo_id, replaced, "superseded renditions")
        if published.again:
            await self.outcomes.again(entry, task.photo_id, published.lane)
        elif deferred:
            await self.upgrades.request(entry, task.photo_id)
        return "published"

    async def _claim(self, entry: Entry, task: Task) -> leases.Claim:
        """One claim per delivery, however often retried in place (kept with the entry).
        The job is claimed before any failure is recorded: only its owner may record one.
        The claim keeps the entry's trace context on a photo without one, and this delivery's
        span id on its attempt row."""
        cached = self.in_flight.claim_of(entry.id)
        if cached is not None:
            return cached
        with tracing.span("claim"):
            claim = await leases.claim(
                self.pool, task.photo_id, entry.id, self.streams.consumer, self.lease,
                self.recorder.lane_of(entry), entry.lane, task.traceparent,
                tracing.delivery_span_id(),
            )  # fmt: skip
        tracing.note(attempt=claim.attempt, claim=claim.outcome)
        self.in_flight.claimed(entry.id, claim)
        self.recorder.begun(entry, claim.history_row)
        if claim.died is not None:  # its worker never ended its span: written here
            stream = self.streams.lane_streams.get(claim.died.lane, "")
            spanwriter.worker_died(claim.died, stream, self.streams.group, str(task.photo_id))
        return claim

    async def _unclaimed(self, entry: Entry, deliveries: int, claim: leases.Claim) -> str:
        if claim.outcome == "exhausted":
            await self._past_the_cap(claim.photo_id, f"attempted {claim.attempt - 1} times")
            return "already"  # a re-render given up, or a photo gone meanwhile
        if claim.outcome == "busy":
            return await self._step_aside(entry, claim)
        if claim.outcome == "paused":
            return self._left_paused(entry)
        if claim.outcome == "already" and claim.state == "processing_failed":
            return await self._finish_failure(entry, deliveries, claim)
        return claim.outcome

    async def _past_the_cap(self, photo_id: uuid.UUID, tried: str) -> None:
        """Checked before any work, so a photo that kills its worker cannot loop. A re-render
        past the cap fails like any re-render (its job records `attempts_exhausted`, the
        photo keeps its renditions and its request); a photo gone or failed meanwhile is
        left as it is."""
        state = await db.photo_state(self.pool, photo_id)
        if state in (None, "processing_failed"):
            return
        code, message = await db.last_error(self.pool, photo_id)
        raise AttemptsExhaustedError(
            f"{tried} without finishing; last error: "
            f"{code or 'none recorded (the worker died)'} {message or ''}".strip()
        )

    async def _step_aside(self, entry: Entry, claim: leases.Claim) -> str:
        """The job's owner lives (its lease runs; a Redis outage ate its heartbeat): its own
        entry goes back to it, counting no delivery. A duplicate entry (another entry of a
        photo a live lease holds) is acked at once: the owner's entry stays pending until
        its outcome, so it finishes the photo, or is reclaimed if its owner dies, and a
        request made meanwhile is answered by the owner's publish (generations)."""
        self.in_flight.settle(entry.id)
        if claim.owner is not None and claim.last_entry != entry.id:
            log.info("duplicate of a photo a live worker is rendering; acked",
                     entry_id=entry.id, owner=claim.owner,
                     rendering_entry=claim.last_entry)  # fmt: skip
            return "already"
        handed = bool(claim.owner) and claim.last_entry == entry.id
        if handed:
            handed = await self._stream(entry).hand_back(entry.id, str(claim.owner))
        log.info("job held by a live worker; stepped aside", entry_id=entry.id,
                 owner=claim.owner, handed_back=handed)  # fmt: skip
        return "busy"

    def _left_paused(self, entry: Entry) -> str:
        """Its scope is paused: the entry stays pending, unacked and uncounted, and is
        reclaimed (by anyone) once idle for DARKROOM_CLAIM_IDLE_MS, when its claim looks at
        the pauses again; a retry keeps its place the same way."""
        self.in_flight.settle(entry.id)
        log.info("scope paused; entry left pending", entry_id=entry.id)
        return "paused"

    async def _finish_failure(self, entry: Entry, deliveries: int, claim: leases.Claim) -> str:
        """The failure of this very entry was committed but its dead letter never written
        (Redis failed, or the worker died in between): write it now. A duplicate entry of
        a failed photo is just acked."""
        if claim.last_entry != entry.id:
            return "already"
        code = claim.error_code or "internal_error"
        stage = ERROR_CODES[code].stage if code in ERROR_CODES else "process"
        if not await self.outcomes.write_dead_letter(
            entry, deliveries, code, claim.last_error or "", stage
        ):
            return "busy"  # another consumer holds the entry now: its letter, its ack
        return "failed"

    async def _fail(self, entry: Entry, deliveries: int, exc: DarkroomError, bound: Any) -> None:
        tracing.failed(exc.code, str(exc))
        claim = self.in_flight.claim_of(entry.id)
        # the heartbeat leaves a settled entry alone: a late one would cancel its backoff
        self.in_flight.settle(entry.id)
        held = Held(0, deliveries)  # a failure before any claim: the stream's delivery count
        if claim is not None:  # PostgreSQL's count, and whether the lease is an upgrade's
            held = Held(claim.token, claim.attempt, claim.upgrade)
        outage = await self.outcomes.fail(entry, held, deliveries, exc, bound)
        if outage is not None:  # intake pauses, /readyz says why, a drain ends with code 3
            await self.gate.wait(outage.stage, outage)


def _refused(entry: Entry, claim: leases.Claim, status: str) -> str:
    """A publish that matched no live lease of this claim: logged once, nothing changed
    (its uploads are deleted before). An erased photo's entry is `skipped`, as its claim
    would be now."""
    log.warning("lease_lost", entry_id=entry.id, photo_id=str(claim.photo_id),
                token=claim.token, refused="publish", entry_taken=status == "lost",
                erased=status == "erased")  # fmt: skip
    return {"lost": "lease_lost", "erased": "skipped"}.get(status, "already")


def _wait_observer(entry: Entry, deliveries: int) -> Callable[[], object] | None:
    """The queue wait (enqueue to render start) of a first delivery; a retry's would
    count its backoff."""
    if deliveries != 1:
        return None
    return lambda: metrics.observe_queue_wait(entry.lane, enqueued_ms(entry))


def _logged_photo_id(entry: Entry) -> str | None:
    """For the log line: the field as text (escaped), cut short, whatever was sent."""
    shown = entry.fields.get("photo_id")
    return None if shown is None else shown[:80]


def _give_up_if_malformed(entry: Entry, deliveries: int) -> None:
    """Past the backstop, a malformed entry names no photo to claim: given up at once
    (parse_task is pure and raises only BadMessageError)."""
    try:
        parse_task(entry)
    except BadMessageError as exc:
        message = f"delivered {deliveries} times without finishing; {exc}"
        raise AttemptsExhaustedError(message) from exc
