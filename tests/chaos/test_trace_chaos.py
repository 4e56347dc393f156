"""Chaos test of the traces: photos ingested by a traced `darkroom ingest` (the producer's
span, exported), three traced workers SIGKILLed one at a time every 1–3 s and Redis
restarted empty mid-run (the sweep puts its photos back), every span exported to a loopback
OTLP receiver that decodes the protobuf; then each photo's trace is judged against
PostgreSQL's attempt history (tests/chaos/traces.py) and the figures are printed."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.rig import Rig
from tests.chaos.test_chaos import VALID, settle
from tests.chaos.traces import judge
from tests.conftest import PHOTOS
from tests.otlp import Receiver, serving

SEED = 20261206
SETTINGS = {"DARKROOM_CONCURRENCY": "2", "DARKROOM_CLAIM_IDLE_MS": "3000",
            "DARKROOM_RETRY_BASE_MS": "200", "DARKROOM_MAX_ATTEMPTS": "5",
            "DARKROOM_SWEEP_AFTER_S": "5", "DARKROOM_SHUTDOWN_GRACE_S": "10",
            "DARKROOM_JOB_TIMEOUT_S": "30", "DARKROOM_DUTY_LEASE_S": "3",
            # 100 % sampling; batches leave every 100 ms, so a delivery that ended is
            # exported unless its worker is killed within about that long after
            "OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "darkroom-chaos"}  # fmt: skip
N_PHOTOS, CHUNK, UPFRONT = 210, 30, 60
WINDOW_S = 45.0
# (seconds after the workers start, event); kills run every 1–3 s throughout the window
SCHEDULE = [(4, "ingest"), (10, "ingest"), (16, "ingest"), (20, "redis_restart"),
            (26, "ingest"), (32, "ingest")]  # fmt: skip
ATTEMPTS_SQL = (
    "SELECT photo_id::text, entry_id, consumer, outcome, ended_at, span_id FROM photo_attempts"
)
TARGET_PCT = 99.9
UNSENT_SQL = "SELECT count(*) AS n FROM photo_attempts WHERE span_id IS NOT NULL AND NOT span_sent"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving() as got:
        yield got


@pytest.fixture
def rig(tmp_path: Path, receiver: Receiver) -> Iterator[Rig]:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    with Rig(tmp_path, SETTINGS | otel) as rig:
        yield rig


class Run:
    """Ingests (every other chunk through the bulk lane, for the feeder to carry the context),
    kills and the Redis restart, on SCHEDULE; records each kill. An ingest runs beside the
    kills (a producer's pace is not the workers'); an event waits for the ingest before it."""

    def __init__(self, rig: Rig, rng: random.Random, chunks: list[list[Path]]) -> None:
        self.rig, self.rng, self.chunks = rig, rng, chunks
        self.photos: list[str] = []
        self.kills: list[dict[str, Any]] = []
        self.spared = self.ingested = 0
        self.producer = ThreadPoolExecutor(1)
        self.ingesting: Future[None] | None = None

    def ingest(self) -> None:
        self.ingested += 1
        bulk = ("--lane", "bulk", "--tenant", f"t{self.ingested % 3}")
        self.photos += self.rig.ingest(self.chunks.pop(0), *(bulk if self.ingested % 2 else ()))

    def busy(self) -> bool:
        if self.ingesting is not None and self.ingesting.done():
            self.ingesting.result()  # an ingest's failure fails the test
            self.ingesting = None
        return self.ingesting is not None

    def kill(self) -> None:
        """A random worker, sparing one on a photo's last attempt but one (tests/chaos/
        test_chaos.py's rule: a photo killed MAX_ATTEMPTS times is dead-lettered by design)."""
        spare = self.rig.holding(int(SETTINGS["DARKROOM_MAX_ATTEMPTS"]) - 1)
        slot = self.rng.randrange(self.rig.n_workers)
        if slot in spare:
            self.spared += 1
            return
        self.kills.append({"consumer": self.rig.workers[slot].consumer, "at": time.time()})
        self.rig.kill_worker(slot)

    def run(self) -> None:
        t0, events, next_kill = time.monotonic(), list(SCHEDULE), 1.0
        while (now := time.monotonic() - t0) < WINDOW_S or events or self.busy():
            self.rig.tend()
            if events and events[0][0] <= now and not self.busy():
                if events.pop(0)[1] == "ingest":
                    self.ingesting = self.producer.submit(self.ingest)
                else:
                    self.rig.restart_redis(down_s=2.0)
            elif now >= next_kill:
                self.kill()
                next_kill = now + self.rng.uniform(1, 3)
            time.sleep(0.05)


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_every_photo_is_one_connected_trace_under_kills_and_a_redis_restart(
    rig: Rig, receiver: Receiver, tmp_path: Path
) -> None:
    """Each photo is one trace from its producer's span, whatever the kills and the Redis wipe
    did, running to its publish with every delivery in it (a killed one's span written by
    its reclaimer) but what a SIGKILL takes (counted apart: the figures of docs/tracing.md)."""
    started, rng = time.monotonic(), random.Random(SEED)
    files = [PHOTOS / VALID[rng.randrange(len(VALID))] for _ in range(N_PHOTOS)]
    rest = files[UPFRONT:]
    n_chunks = sum(kind == "ingest" for _, kind in SCHEDULE)
    run = Run(rig, rng, [rest[i::n_chunks] for i in range(n_chunks)])
    for i in range(0, UPFRONT, CHUNK):
        run.chunks.insert(0, files[i : i + CHUNK])
        run.ingest()
    for slot in range(rig.n_workers):
        rig.start_worker(slot)
    run.run()
    settled = settle(rig)
    unsent = late_spans_written(rig)
    stop_codes = rig.stop_workers(grace_s=20)
    time.sleep(0.5)  # the last exports of the workers' flush at exit are in
    attempts = rig.query(ATTEMPTS_SQL)
    states = Counter(r["state"] for r in rig.query("SELECT processing_state AS state FROM photos"))
    judged = judge(receiver.spans, attempts, run.photos)
    figures = {
        **judged.figures(),
        "target_pct": TARGET_PCT,
        "states": dict(states),
        "sigkills": len(run.kills), "kills_spared": run.spared, "redis_restarts": 1,
        "attempts": len(attempts), "spans": len(receiver.spans), "exports": receiver.exports,
        "exports_cut_by_a_kill": receiver.broken,
        # a span exported twice: a late copy of one whose export's report a kill cut off
        "spans_twice": sum(n > 1 for n in Counter(s.span_id for s in receiver.spans).values()),
        "late_spans": sum(bool(s.attributes.get("darkroom.late")) for s in receiver.spans),
        "settle": settled, "stop_codes": stop_codes, "unsent_spans_left": unsent,
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    saved = figures | {
        "kills": run.kills,
        "not_whole": {p: str(v) for p, v in judged.verdicts.items() if not v.whole},
    }
    (tmp_path / "trace-figures.json").write_text(json.dumps(saved, indent=2, default=str))
    # every span, for bench/trace_view.py to draw one photo's trace
    (tmp_path / "trace-spans.json").write_text(json.dumps([asdict(s) for s in receiver.spans]))
    print("\ntrace chaos figures:\n" + json.dumps(figures, indent=2, default=str))
    assert settled == "settled" and states == {"processed": N_PHOTOS}, figures
    assert len(run.photos) == N_PHOTOS and len(run.kills) >= 10, figures
    # the context is never lost: every photo's spans are in its producer's trace
    assert judged.share("one_trace") == 1.0, figures
    # a delivery a kill cut short has its span written by the delivery that reclaimed its job
    assert figures["killed_attempts_written"] > 0, figures
    # and every photo's trace is whole, the producer's span to the final publish with every
    # attempt in it: a killed delivery's span written by its reclaim, or late from the history
    # like an ended one whose batch a kill took (so 99.9 % is every photo of a run this size)
    assert figures["whole_traces_pct"] >= TARGET_PCT, (figures, saved["not_whole"])


def late_spans_written(rig: Rig, timeout_s: float = 90.0) -> int:
    """Wait for the surviving workers' late writers to settle every attempt row whose span no
    export confirmed (a delivery cut off from its batch by a kill); how many are left."""
    deadline = time.monotonic() + timeout_s
    while (left := rig.query(UNSENT_SQL)[0]["n"]) and time.monotonic() < deadline:
        rig.tend()
        time.sleep(0.5)
    return int(left)
