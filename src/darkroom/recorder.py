"""Each delivery's row in the attempt history, as the worker lives it: inserted `running`
by the claim's own statement (store/db.py), its stage timings and the render's peak RSS
gathered meanwhile, finished as `published` by the publishing commit itself, or by one
UPDATE when it ends otherwise (store/history.py holds the SQL).
The UPDATE is best effort: a failed one is logged, never the photo's failure nor more than
one statement's delay.
And the history's retention: batched deletes of the expired days, by the holder of its
leased duty (duty.py). Unfenced: deleting rows past retention is safe to repeat.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import anyio
import structlog

from darkroom import metrics, tracing
from darkroom.duty import Duty, process_holder
from darkroom.errors import DarkroomError
from darkroom.queue.messages import Entry, parse_task
from darkroom.store import db, duties, history, publishing

log = structlog.get_logger("darkroom.recorder")

PRUNE_EVERY_S = 600.0
# A batch is one short DELETE (about 60 ms for 5,000 rows here, docs/benchmarks.md); the
# pause between batches leaves the database to the workers.
PRUNE_BATCH = 5000
PRUNE_PAUSE_S = 0.1
# The lease of a prune run outside a worker (a test, a tool): the worker passes its own duty.
ONE_OFF_LEASE_S = 10.0


@dataclass
class Recorder:
    pool: db.Pool
    consumer: str
    enabled: bool = True  # DARKROOM_HISTORY
    # The deliveries in flight, by entry id; each is forgotten at its `end`.
    attempts: dict[str, history.Attempt] = field(default_factory=dict)

    def attempt(self, entry: Entry) -> history.Attempt:
        return self.attempts.setdefault(entry.id, history.Attempt())

    @contextlib.contextmanager
    def timed(self, entry: Entry, stage: str) -> Iterator[None]:
        """The stage's time, for the metrics, for the delivery's row (a failed one's too) and
        as a child span of the delivery's trace (darkroom.tracing)."""
        started_s = time.perf_counter()
        with tracing.span(stage):
            try:
                yield
            finally:  # inside the span: its trace id is the observation's exemplar
                elapsed_s = time.perf_counter() - started_s
                metrics.observe(metrics.STAGE_SECONDS.labels(stage), elapsed_s)
                self.attempt(entry).add(stage, elapsed_s * 1000)

    def lane_of(self, entry: Entry) -> str | None:
        """What the claim writes the delivery's `running` row with (its lane), in its own
        statement: a worker that dies from there on leaves the row, and the timeline
        shows the death. None: no row (DARKROOM_HISTORY=false)."""
        return entry.lane if self.enabled else None

    def begun(self, entry: Entry, row_id: int | None) -> None:
        """The row the claim wrote, if it claimed a job; `end` finishes it."""
        if row_id is not None:
            self.attempt(entry).row_id = row_id

    def publishing(self, entry: Entry) -> publishing.AttemptRow:
        """The delivery's row as the publishing commit finishes it (no row: nothing)."""
        attempt = self.attempt(entry)
        if attempt.row_id is None:  # no row: nothing claimed, or DARKROOM_HISTORY=false
            return publishing.AttemptRow()
        stages = attempt.stages_ms.get
        return publishing.AttemptRow(attempt.row_id, stages("download"), stages("render"),
                             stages("upload"), attempt.peak_rss_mb)  # fmt: skip

    def published(self, entry: Entry) -> None:
        """The publishing commit finished the row (if it was handed one) as `published`, so
        `end` sends no UPDATE for it, whatever ends the delivery after it (a stop before the
        ack, an ack that failed). Only a statement saved: FINISH_SQL leaves a finished row
        alone anyway, which is what keeps it `published` when the commit's reply was lost."""
        attempt = self.attempt(entry)
        attempt.finished = attempt.row_id is not None

    def forget(self, entry: Entry) -> None:
        """A delivery cut short without an end (stopped before its claim was given back):
        its row, if any, stays `running` and reads as `worker_died` once its lease is gone."""
        self.attempts.pop(entry.id, None)

    async def end(self, entry: Entry, ending: history.Ending) -> None:
        """Finish the delivery's row, or write it whole when it has none (nothing was
        claimed, or its insert failed). Once per delivery: the attempt is forgotten here."""
        attempt = self.attempts.pop(entry.id, None) or history.Attempt()
        if not self.enabled or attempt.finished:
            return
        with _logged(entry):
            if attempt.row_id is not None:
                await history.finish(self.pool, attempt, ending)
            else:
                photo_id = _photo_id(entry)
                await history.record(self.pool, photo_id, entry.id, self.consumer, entry.lane,
                                     attempt, ending, tracing.delivery_span_id())  # fmt: skip


@contextlib.contextmanager
def _logged(entry: Entry) -> Iterator[None]:
    try:
        yield
    except DarkroomError as exc:
        log.warning("attempt history not written", entry_id=entry.id, error_code=exc.code,
                    error=str(exc))  # fmt: skip


def _photo_id(entry: Entry) -> uuid.UUID | None:
    """None for a malformed entry (bad_message): its row has no photo."""
    try:
        return parse_task(entry).photo_id
    except DarkroomError:
        return None


async def prune_forever(
    pool: db.Pool, keep_days: float, duty: Duty, ready: Callable[[], bool]
) -> None:
    """The history's retention, every PRUNE_EVERY_S while `ready` (the dependencies are up
    and the worker is not stopping)."""
    while True:
        await anyio.sleep(PRUNE_EVERY_S)
        if ready():
            try:
                await prune_expired(pool, keep_days, duty)
            except DarkroomError as exc:
                log.warning("history pruning failed", error_code=exc.code, error=str(exc))
            except Exception:  # a bug must not end the worker
                log.exception("history pruning failed unexpectedly")


async def prune_expired(pool: db.Pool, keep_days: float, duty: Duty | None = None) -> int:
    """Delete the rows older than `keep_days`, batch by batch; how many (0 when another
    worker holds the duty; a lost duty stops before the next batch)."""
    duty = duty or Duty(duties.PRUNE, pool, process_holder("prune"), ONE_OFF_LEASE_S)
    deleted = 0
    async with duty.hold() as tenure:
        while tenure is not None and tenure.live():
            batch = await history.prune_batch(pool, keep_days, PRUNE_BATCH)
            deleted += batch
            if batch < PRUNE_BATCH:
                break
            await anyio.sleep(PRUNE_PAUSE_S)
    if deleted:
        log.info("attempt history pruned", rows=deleted, keep_days=keep_days)
    return deleted
