"""Spans the exporter never confirmed, written late from the attempt history (docs/tracing.md,
"Spans the exporter never confirmed"). Runs in every traced worker: it records on each
delivery's attempt row that its `darkroom.process` span left (the exporter's report), and
past a grace period writes the span of each row nobody confirmed, with the id the claim kept
on it, so a SIGKILL between a delivery's end and its batch's export (or during its wait for
an ack through a Redis outage) costs the trace no attempt. No lease: the rows are taken with
`FOR UPDATE SKIP LOCKED`, one writer per row, and the only write is `span_sent`, which no
photo's state reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
import structlog

from darkroom import confirmations, otlpwire, spanwriter, tracing
from darkroom.errors import DarkroomError
from darkroom.queue.pacing import Backoff, Throttle
from darkroom.queue.streams import Streams
from darkroom.store import spans
from darkroom.store.db import Pool

log = structlog.get_logger("darkroom.latespans")

CONFIRM_EVERY_S = 1.0
BATCH = 200
# The grace is this many times the longest a span may wait for its batch (OTEL_BSP_SCHEDULE_
# DELAY) and its export (the exporter's timeout): a span that took that long has been lost,
# not delayed. At least MIN_GRACE_S.
GRACE_FACTOR = 3
MIN_GRACE_S = 10.0
# A late pass whose export failed (the collector is away) waits longer each time, up to this:
# its rows stay for the next pass, and the batch queue is left to the live spans.
MAX_PASS_WAIT_S = 600.0
# The exit's last confirmations: the flush of what ended before the stop (bounded by the
# exporter's timeout), then their marks; so many times that timeout at most.
FINAL_FACTOR = 2


def grace_s(environ: Mapping[str, str] = os.environ) -> float:
    """From the standard variables, as the SDK reads them: the batch delay in milliseconds,
    the exporter's timeout in seconds. 24 s with the SDK's defaults (5 s, and darkroom's
    3 s export timeout)."""
    try:
        delay_s = float(environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")) / 1000
    except ValueError:
        delay_s = 5.0
    if not (math.isfinite(delay_s) and delay_s >= 0):
        delay_s = 5.0
    return max(MIN_GRACE_S, GRACE_FACTOR * (delay_s + otlpwire.export_timeout_s(environ)))


@dataclass
class LateSpans:
    pool: Pool
    streams: Streams
    grace_s: float = field(default_factory=grace_s)
    _closing: bool = False
    _throttle: Throttle = field(default_factory=Throttle)
    _backoff: Backoff = field(default_factory=lambda: Backoff(10.0, MAX_PASS_WAIT_S))
    # One `confirm` at a time: the stop's waits for the loop's, whose pairs it drained.
    _confirming: anyio.Lock = field(default_factory=anyio.Lock)

    async def run(self) -> None:
        """Until cancelled; nothing at all when this worker does not trace."""
        if not tracing.on():
            return
        loop, confirmed = asyncio.get_running_loop(), asyncio.Event()
        confirmations.when_confirmed(lambda: _wake(loop, confirmed))
        try:
            await self._loop(confirmed)
        finally:
            confirmations.when_confirmed(None)  # the exit's flush runs after the loop closed

    async def _loop(self, confirmed: asyncio.Event) -> None:
        next_late = time.monotonic() + self.grace_s
        while True:
            with anyio.move_on_after(CONFIRM_EVERY_S):
                await confirmed.wait()
            confirmed.clear()
            try:
                await self.confirm()
                if time.monotonic() >= next_late and not self._closing:
                    next_late = time.monotonic() + await self._pass()
                self._throttle.clear()
            except DarkroomError as exc:
                if (quiet := self._throttle.allow(exc.code, time.monotonic())) is not None:
                    log.warning("late spans failed", error_code=exc.code, error=str(exc),
                                repeats_not_logged=quiet)  # fmt: skip
            except Exception:  # a bug must not end the worker: next turn
                log.exception("late spans failed unexpectedly")

    async def _pass(self) -> float:
        """One late pass; how long until the next (longer after a failed export)."""
        written, exported = await self.write_late()
        if written and not exported:
            return self._backoff.next_s() + self.grace_s / 2
        self._backoff.reset()
        return self.grace_s / 2

    async def final(self) -> None:
        """At the stop, after the last delivery: export what ended and mark it, so the exit's
        own flush leaves nothing a late writer would copy. No late pass after this."""
        self._closing = True
        if not tracing.on():
            return
        with anyio.move_on_after(FINAL_FACTOR * otlpwire.export_timeout_s()):
            await anyio.to_thread.run_sync(tracing.flush)
            with contextlib.suppress(DarkroomError):  # the late writers will see them
                await self.confirm()

    async def confirm(self) -> None:
        """Record what the exporter delivered; given back should the database be away."""
        async with self._confirming:
            pairs = confirmations.confirmed()
            try:
                await spans.sent(self.pool, _parsed(pairs))
            except BaseException:
                confirmations.unconfirmed(pairs)
                raise

    async def write_late(self) -> tuple[int, bool]:
        """One batch of unconfirmed rows past the grace: their spans written and exported
        while the rows stay locked, then the rows whose export was confirmed (or that had
        nothing to write) settled. How many spans were written, and whether they left."""
        async with spans.unsent(self.pool, self.grace_s, BATCH) as batch:
            if not batch.rows:
                return 0, True
            written = [r for r in batch.rows if self._written(r)]
            exported = not written or await anyio.to_thread.run_sync(tracing.flush)
            # only this batch's rows here; the rest of the report goes back to `confirm`
            delivered = set(confirmations.confirmed())
            ours = {(str(r.photo_id), r.span_id) for r in written} & delivered
            confirmations.unconfirmed(delivered - ours)
            await batch.settle(
                r for r in batch.rows if r not in written or (str(r.photo_id), r.span_id) in ours
            )
        if written:
            log.info("late spans written", count=len(written), exported=len(ours))
        return len(written), exported and len(ours) == len(written)

    def _written(self, unsent: spans.Unsent) -> bool:
        stream = self.streams.lane_streams.get(unsent.lane, "")
        return spanwriter.written_late(unsent, stream, self.streams.group)


def _wake(loop: asyncio.AbstractEventLoop, confirmed: asyncio.Event) -> None:
    """From the export thread; the loop may be closing under it."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(confirmed.set)


def _parsed(pairs: list[tuple[str, str]]) -> list[tuple[uuid.UUID, str]]:
    """The exporter's pairs whose photo id is one (a bad message's span names any text)."""
    out = []
    for photo, span_id in pairs:
        try:
            out.append((uuid.UUID(photo), span_id))
        except ValueError:
            continue
    return out
