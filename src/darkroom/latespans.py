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
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import structlog

from darkroom import spanwriter, tracing
from darkroom.errors import DarkroomError
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


def grace_s(environ: Mapping[str, str] = os.environ) -> float:
    """From the standard variables (milliseconds for both): 24 s with the SDK's defaults (a
    5 s batch delay, darkroom's 3 s export timeout)."""
    delay_ms = _ms(environ, ("OTEL_BSP_SCHEDULE_DELAY",), 5000.0)
    timeout_ms = _ms(environ, ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
                     tracing.EXPORT_TIMEOUT_S * 1000)  # fmt: skip
    return max(MIN_GRACE_S, GRACE_FACTOR * (delay_ms + timeout_ms) / 1000)


def _ms(environ: Mapping[str, str], names: tuple[str, ...], default: float) -> float:
    for name in names:
        try:
            value = float(environ.get(name, ""))
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            return value
    return default


@dataclass
class LateSpans:
    """`stream_of` names the stream of a lane (for the span's messaging attributes)."""

    pool: Pool
    stream_of: Callable[[str], str]
    group: str
    grace_s: float

    async def run(self) -> None:
        next_late = time.monotonic() + self.grace_s
        loop, confirmed = asyncio.get_running_loop(), asyncio.Event()
        tracing.when_confirmed(lambda: loop.call_soon_threadsafe(confirmed.set))
        while True:
            with anyio.move_on_after(CONFIRM_EVERY_S):
                await confirmed.wait()
            confirmed.clear()
            try:
                await self.confirm()
                if time.monotonic() >= next_late:
                    next_late = time.monotonic() + self.grace_s / 2
                    await self.write_late()
            except DarkroomError as exc:
                log.warning("late spans failed", error_code=exc.code, error=str(exc))
            except Exception:  # a bug must not end the worker: next turn
                log.exception("late spans failed unexpectedly")

    async def confirm(self) -> None:
        """Record what the exporter delivered; given back should the database be away."""
        pairs = tracing.confirmed()
        try:
            await spans.sent(self.pool, _parsed(pairs))
        except DarkroomError:
            tracing.unconfirmed(pairs)
            raise

    async def write_late(self) -> int:
        """One batch of unconfirmed rows past the grace: their spans written and exported
        while the rows stay locked, then settled. How many spans were written."""
        async with spans.unsent(self.pool, self.grace_s, BATCH) as batch:
            if not batch.rows:
                return 0
            written = [r for r in batch.rows if self._written(r)]
            if written:
                await anyio.to_thread.run_sync(tracing.flush)
            delivered = set(tracing.confirmed())
            await spans.sent(batch.conn, _parsed(delivered))
            # what was written settles once its export is confirmed; nothing to write, at once
            await batch.settle(
                r
                for r in batch.rows
                if r not in written or (str(r.photo_id), r.span_id) in delivered
            )
        if written:
            log.info("late spans written", count=len(written))
        return len(written)

    def _written(self, unsent: spans.Unsent) -> bool:
        return spanwriter.written_late(unsent, self.stream_of(unsent.lane), self.group)


def _parsed(pairs: list[tuple[str, str]] | set[tuple[str, str]]) -> list[tuple[uuid.UUID, str]]:
    """The exporter's pairs whose photo id is one (a bad message's span names any text)."""
    out = []
    for photo, span_id in pairs:
        try:
            out.append((uuid.UUID(photo), span_id))
        except ValueError:
            continue
    return out
