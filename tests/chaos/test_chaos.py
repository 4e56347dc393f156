"""Chaos test of "Never lose a photo, never loop on one": every photo XADDed ends terminal,
whatever crashes, restarts or outages happen, and a duplicate delivery never does harm."""

from __future__ import annotations

import bisect
import json
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import redis

from tests.chaos.rig import BUCKET, DEAD, GROUP, PREFIX, STREAM, Rig
from tests.conftest import PHOTOS

SEED = 20240611
SETTINGS = {
    "DARKROOM_CONCURRENCY": "2",
    "DARKROOM_CLAIM_IDLE_MS": "3000",
    "DARKROOM_RETRY_BASE_MS": "200",
    "DARKROOM_MAX_ATTEMPTS": "5",
    "DARKROOM_SWEEP_AFTER_S": "5",
    "DARKROOM_SHUTDOWN_GRACE_S": "10",
    "DARKROOM_JOB_TIMEOUT_S": "30",
}
VALID = [f"Landscape_{i}.jpg" for i in range(1, 9)] + [
    "4.webp", "animated-loop-3.gif", "embedgravitybird.png",
    "Channel_digital_image_CMYK_color.jpg", "png-alpha-64bit.png",
]  # fmt: skip
N_VALID, N_NOISE, N_TRUNCATED, UPFRONT, CHUNK = 500, 10, 10, 280, 70
WINDOW_S, DRAIN_DEADLINE_S, STALL_S = 45.0, 600.0, 60.0
# Seconds after the workers start; a random worker is SIGKILLed every 1–3 s in between.
SCHEDULE = [(3, "ingest"), (5, "sigstop"), (8, "ingest"), (12, "s3_pause"), (16, "ingest"),
            (21, "ingest"), (25, "pg_terminate"), (29, "pg_cut"), (33, "redis_restart"),
            (37, "ingest"), (41, "ingest")]  # fmt: skip
FAULT_KINDS = {"sigkill", "sigstop", "s3_pause", "pg_terminate", "pg_cut", "redis_restart"}


def corpus(tmp: Path, rng: random.Random) -> list[tuple[Path, str]]:
    """(file, expected end): valid photos, random bytes named .jpg, truncated JPEGs."""
    files = [(PHOTOS / VALID[i % len(VALID)], "processed") for i in range(N_VALID)]
    for i in range(N_NOISE):
        (path := tmp / f"noise-{i}.jpg").write_bytes(
            b"chaos" + rng.randbytes(rng.randint(1000, 50_000))
        )
        files.append((path, "unsupported_format"))
    for i in range(N_TRUNCATED):
        data = (PHOTOS / f"Landscape_{i % 8 + 1}.jpg").read_bytes()[: rng.randint(20_000, 200_000)]
        (path := tmp / f"truncated-{i}.jpg").write_bytes(data)
        files.append((path, "corrupt_image"))
    rng.shuffle(files)
    return files


def ingest(rig: Rig, chunk: list[tuple[Path, str]]) -> dict[str, str]:
    return dict(zip(rig.ingest([p for p, _ in chunk]), (e for _, e in chunk), strict=True))


def unfinished(rig: Rig) -> int:
    return int(rig.query(
        "SELECT count(*) AS n FROM photos WHERE NOT ((processing_state = 'processed'"
        " AND visibility = 'published') OR processing_state = 'processing_failed')")[0]["n"])  # fmt: skip


def backlog(rig: Rig) -> tuple[int, int]:
    """(work stream length, entries pending in the group)."""
    with rig.redis.client() as r:
        try:
            return int(r.xlen(STREAM)), int(r.xpending(STREAM, GROUP)["pending"])
        except redis.ResponseError:  # no group
            return int(r.xlen(STREAM)), 0


class Chaos:
    """Runs SCHEDULE and the kills for WINDOW_S (or until the work is done); logs each fault."""

    def __init__(self, rig: Rig, rng: random.Random, chunks: list[Any], expected: dict[str, str]):
        self.rig, self.rng, self.chunks, self.expected = rig, rng, chunks, expected
        self.faults: list[dict[str, Any]] = []
        self.lifts: list[tuple[float, Callable[[], None]]] = []
        self.frozen: int | None = None

    def fault(self, kind: str, **detail: Any) -> dict[str, Any]:
        self.faults.append(f := {"kind": kind, "at": time.time(), "lifted": time.time(), **detail})
        return f

    def hold(self, fault: dict[str, Any], until: float, lift: Callable[[], None]) -> None:
        self.lifts.append((until, lambda: (lift(), fault.update(lifted=time.time()))))

    def run(self) -> float:
        t0, events, next_kill, next_check = time.monotonic(), list(SCHEDULE), 1.0, 0.0
        while (now := time.monotonic() - t0) < WINDOW_S:
            self.rig.tend()
            for item in [x for x in self.lifts if x[0] <= now]:
                self.lifts.remove(item)
                item[1]()
            if events and events[0][0] <= now:
                getattr(self, events.pop(0)[1])(now)
            elif now >= next_kill:
                slot = self.rng.choice([s for s in range(self.rig.n_workers) if s != self.frozen])
                self.fault("sigkill", slot=slot)
                self.rig.kill_worker(slot)
                next_kill = now + self.rng.uniform(1, 3)
            elif not events and not self.lifts and now >= next_check:
                if unfinished(self.rig) == 0:
                    break
                next_check = now + 1
            time.sleep(0.05)
        for _, lift in self.lifts:
            lift()
        return time.monotonic() - t0

    def ingest(self, now: float) -> None:
        self.expected |= ingest(self.rig, self.chunks.pop(0))

    def sigstop(self, now: float) -> None:
        self.frozen = slot = self.rng.randrange(self.rig.n_workers)
        self.rig.signal_worker(slot, signal.SIGSTOP)
        self.hold(self.fault("sigstop", slot=slot), now + 5, lambda: self.thaw(slot))

    def thaw(self, slot: int) -> None:
        self.rig.signal_worker(slot, signal.SIGCONT)
        self.frozen = None

    def s3_pause(self, now: float) -> None:
        self.rig.s3_proxy.pause()
        self.hold(self.fault("s3_pause"), now + 10, self.rig.s3_proxy.resume)

    def pg_terminate(self, now: float) -> None:
        self.fault("pg_terminate", backends=self.rig.pg_terminate())

    def pg_cut(self, now: float) -> None:
        self.fault("pg_cut", connections=self.rig.pg_proxy.cut())

    def redis_restart(self, now: float) -> None:
        fault = self.fault("redis_restart")
        self.rig.restart_redis(down_s=2.0)
        fault["lifted"] = time.time()


def settle(rig: Rig) -> str:
    """With faults over, wait until every photo is terminal and the group holds nothing."""
    deadline, last, changed = time.monotonic() + DRAIN_DEADLINE_S, None, time.monotonic()
    while (state := (unfinished(rig), *backlog(rig))) != (0, 0, 0):
        rig.tend()
        if state != last:
            last, changed = state, time.monotonic()
        if time.monotonic() - changed > STALL_S or time.monotonic() > deadline:
            return f"gave up: (unfinished, stream length, pending) stuck at {state}"
        time.sleep(1)
    return "settled"


def missing_renditions(rig: Rig, rows: list[dict[str, Any]]) -> list[str]:
    def absent(key: str) -> bool:
        try:
            rig.s3.head_object(Bucket=BUCKET, Key=PREFIX + key)
            return False
        except botocore.exceptions.ClientError:
            return True

    keys = [r["key"] for row in rows for r in json.loads(row["renditions"] or "[]")]
    with ThreadPoolExecutor(8) as pool:
        return [k for k, gone in zip(keys, pool.map(absent, keys), strict=True) if gone]


def recovery(faults: list[dict[str, Any]], done: list[float]) -> dict[str, float | None]:
    """Per fault kind, the longest wait from lifting a fault to the next finished entry."""
    worst: dict[str, float | None] = {}
    for f in faults:
        i = bisect.bisect(done, f["lifted"])
        gap = round(done[i] - f["lifted"], 2) if i < len(done) else None
        prev = worst.get(f["kind"], 0.0)
        worst[f["kind"]] = None if gap is None or prev is None else max(prev, gap)
    return worst


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with Rig(tmp_path, SETTINGS) as rig:
        yield rig


@pytest.mark.chaos
@pytest.mark.timeout(1200)
def test_no_photo_lost_or_looped_under_chaos(rig: Rig, tmp_path: Path) -> None:
    """Kills, a freeze, a Redis wipe, PG and S3 outages: every photo ends terminal, once."""
    started, rng = time.monotonic(), random.Random(SEED)
    files, expected = corpus(tmp_path, rng), {}
    for i in range(0, UPFRONT, CHUNK):
        expected |= ingest(rig, files[i : min(i + CHUNK, UPFRONT)])
    n_chunks = sum(kind == "ingest" for _, kind in SCHEDULE)
    chunks = [files[UPFRONT:][i::n_chunks] for i in range(n_chunks)]
    rig.start_workers()
    chaos = Chaos(rig, rng, chunks, expected)
    window_s = chaos.run()
    sql = "SELECT id::text, processed_at FROM photos WHERE processing_state = 'processed'"
    snapshot = {r["id"]: r["processed_at"] for r in rig.query(sql)}
    settled = settle(rig)
    stop_codes = rig.stop_workers(grace_s=20)
    drain = rig.cli("run", "--drain", direct=False, timeout=180)
    (rig.logs / "drain.log").write_text(drain.stderr)

    rows = {r["id"]: r for r in rig.query(
        "SELECT p.id::text, p.processing_state AS state, p.visibility, p.error_code,"
        " p.processed_at, p.renditions, p.updated_at, j.state AS job, j.attempt, j.last_error"
        " FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id")}  # fmt: skip
    with rig.redis.client() as r:
        letters = [fields for _, fields in r.xrange(DEAD)]
    stream_len, pending = backlog(rig)
    records = rig.log_records()
    done = sorted(x["ts"] for x in records if x.get("event") == "entry done")
    events = Counter(x.get("event") for x in records)
    outcomes = Counter(x.get("outcome") for x in records if x.get("event") == "entry done")
    published = Counter(x.get("photo_id") for x in records if x.get("outcome") == "published")
    processed = [x for x in rows.values() if x["state"] == "processed"]
    failed = {i: x["error_code"] for i, x in rows.items() if x["state"] == "processing_failed"}
    restart = max((f["lifted"] for f in chaos.faults if f["kind"] == "redis_restart"), default=0)
    lettered = Counter(x.get("photo_id") for x in letters)
    faults = Counter(f["kind"] for f in chaos.faults)
    figures = {
        "photos": len(expected),
        "undecodable": sum(e != "processed" for e in expected.values()),
        "states": dict(Counter((x["state"], x["visibility"]) for x in rows.values())),
        "faults": dict(faults),
        "pg_backends_terminated": sum(f.get("backends", 0) for f in chaos.faults),
        "pg_connections_cut": sum(f.get("connections", 0) for f in chaos.faults),
        "worker_self_exits": dict(Counter(str(c["tail"][-1:])[:160] for c in rig.crashes)),
        "worker_exit_codes_on_sigterm": stop_codes,
        "settle": settled,
        "deliveries_logged": events["entry done"] + events["attempt failed; will retry"]
        + events["photo failed; dead-lettered"],
        "attempts_sum": sum(x["attempt"] or 0 for x in rows.values()),
        "outcomes": dict(outcomes),
        "duplicates_absorbed": outcomes["already"],
        "retries": events["attempt failed; will retry"],
        "dead_letters": len(letters),
        "worst_recovery_s": recovery(chaos.faults, done),
        "longest_gap_between_done_s": round(max(map(float.__sub__, done[1:], done), default=0), 2),
        "chaos_window_s": round(window_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
        "logs": str(rig.logs),
    }  # fmt: skip
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=2, default=str))
    print("\nchaos figures:\n" + json.dumps(figures, indent=2, default=str))

    def sample(ids: list[str]) -> str:
        return "; ".join(
            f"{i} {expected.get(i)}→{rows[i]['state'] if i in rows else 'no row'}"
            f" job={rows[i]['job'] if i in rows else '-'} attempt={rows[i]['attempt'] if i in rows else '-'}"
            f" {(rows[i]['last_error'] or '')[:120] if i in rows else ''}"
            for i in ids[:5]
        )  # fmt: skip

    problems = []
    if missing := FAULT_KINDS - set(faults):
        problems.append(f"rig: faults never injected: {sorted(missing)}")
    ok = [("processed", "published"), ("processing_failed", "unpublished")]
    if lost := [i for i in expected if i not in rows or (rows[i]["state"], rows[i]["visibility"]) not in ok]:  # fmt: skip
        problems.append(f"{len(lost)} photos lost (not terminal): {sample(lost)}")
    if gone := missing_renditions(rig, processed):
        problems.append(f"{len(gone)} renditions of processed photos missing in S3: {gone[:5]}")
    # Dead letters. The Redis restart wipes the letters written before it, so the rule is:
    # every letter present names a failed photo with the same code, at most one per photo,
    # and every photo whose failure was committed after Redis came back has its letter.
    if wrong := [x for x in letters if failed.get(x.get("photo_id")) != x.get("error_code")]:
        problems.append(f"{len(wrong)} dead letters do not match a failed photo: {wrong[:3]}")
    if twice := [i for i, n in lettered.items() if n > 1]:
        problems.append(f"{len(twice)} photos dead-lettered more than once: {twice[:5]}")
    if unlettered := [i for i in failed if i not in lettered and rows[i]["updated_at"].timestamp() > restart]:  # fmt: skip
        problems.append(f"{len(unlettered)} photos failed after the Redis restart have no dead letter: {sample(unlettered)}")  # fmt: skip
    if bad := [i for i, code in failed.items() if expected.get(i) != code]:
        problems.append(f"{len(bad)} photos failed with an unexpected code: {sample(bad)}")
    undecodable = [i for i, e in expected.items() if e != "processed"]
    if not_failed := [i for i in undecodable if i not in failed]:
        problems.append(f"{len(not_failed)} undecodable photos did not fail: {sample(not_failed)}")
    if (stream_len, pending) != (0, 0):
        problems.append(f"work stream not empty after drain: length={stream_len} pending={pending}")
    final = {r["id"]: r["processed_at"] for r in processed}
    if moved := [i for i, at in snapshot.items() if final.get(i) != at]:
        problems.append(
            f"{len(moved)} photos had processed_at changed after the window: {moved[:5]}"
        )
    if republished := [i for i, n in published.items() if n > 1]:
        problems.append(f"{len(republished)} photos logged as published more than once: {republished[:5]}")  # fmt: skip
    assert not problems, "\n".join(problems) + "\nfigures: " + json.dumps(figures, default=str)
