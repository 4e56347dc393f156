"""Chaos test of "Never lose a photo, never loop on one": every photo XADDed ends terminal,
whatever crashes, restarts, outages or failovers happen, a duplicate delivery never does
harm, and a malformed entry is dead-lettered once."""

from __future__ import annotations

import bisect
import json
import math
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest

from darkroom.store.pauses import NO_PHOTO
from tests.chaos import failover
from tests.chaos.actions import Actions
from tests.chaos.rig import BUCKET, DEAD, EVENTS, PREFIX, STREAM, Rig
from tests.conftest import PHOTOS
from tests.malformed import SHAPES

SEED = 20240611
SETTINGS = {"DARKROOM_CONCURRENCY": "2", "DARKROOM_CLAIM_IDLE_MS": "3000",
            "DARKROOM_RETRY_BASE_MS": "200", "DARKROOM_MAX_ATTEMPTS": "5",
            "DARKROOM_SWEEP_AFTER_S": "5", "DARKROOM_SHUTDOWN_GRACE_S": "10",
            "DARKROOM_JOB_TIMEOUT_S": "30",
            # a SIGKILLed holder's duties (feeder, relay) wait for their lease: keep it short
            "DARKROOM_DUTY_LEASE_S": "3"}  # fmt: skip
VALID = [*(f"Landscape_{i}.jpg" for i in range(1, 9)), "4.webp", "animated-loop-3.gif",
         "embedgravitybird.png", "png-alpha-64bit.png",
         "Channel_digital_image_CMYK_color.jpg"]  # fmt: skip
N_VALID, N_NOISE, N_TRUNCATED, UPFRONT, CHUNK = 500, 10, 10, 200, 50
WINDOW_S, DRAIN_DEADLINE_S, STALL_S = 122.0, 600.0, 60.0
# Seconds after the workers start; a random worker is SIGKILLed every 1–3 s in between. The
# failovers (failover.FAILOVER_S long: 10, 30, 20, 15 s) follow the Redis restart, each after
# a chunk is ingested (so it meets a backlog) and ≥ failover.TAIL_S after the previous one;
# the last one is S3 throttling the rendition uploads (503 SlowDown) while the probe passes.
# The operator's actions (tests/chaos/actions.py): a 4 s pause of the bulk lane in the S3
# pause, a pause of everything resumed 4 s later, and an erase of 5 photos, some in flight.
SCHEDULE = [(3, "ingest"), (5, "sigstop"), (8, "ingest"), (12, "s3_pause"), (13, "pause_lane"),
            (16, "ingest"), (21, "ingest"), (22, "pause_all"), (25, "pg_terminate"),
            (29, "pg_cut"), (33, "redis_restart"), (37, "ingest"), (39, "malformed"),
            (41, "ingest"), (42, "erase"), (44, "ingest"),
            (45, "redis_replica"),
            (60, "ingest"), (61, "pg_read_only"), (96, "ingest"), (97, "s3_denied"),
            (122, "ingest"), (123, "s3_slowdown")]  # fmt: skip
# In the S3 SlowDown window (and failover.TAIL_S after it), deliveries that ended, per
# photo: a transient error waits in place, so about one each (kills add their redelivery).
SLOWDOWN_DELIVERIES_PER_PHOTO = 1.10
FAULT_KINDS = {"sigkill", "sigstop", "s3_pause", "pg_terminate", "pg_cut", "redis_restart",
               *failover.FAILOVER_S}  # fmt: skip


def corpus(tmp: Path, rng: random.Random) -> list[tuple[Path, str]]:
    """(file, expected end state or error code), shuffled."""
    files = [(PHOTOS / VALID[i % len(VALID)], "processed") for i in range(N_VALID)]
    for i in range(N_NOISE):  # random bytes named .jpg
        (path := tmp / f"noise-{i}.jpg").write_bytes(rng.randbytes(rng.randint(1000, 50_000)))
        files.append((path, "unsupported_format"))
    for i in range(N_TRUNCATED):
        data = (PHOTOS / f"Landscape_{i % 8 + 1}.jpg").read_bytes()[: rng.randint(20_000, 200_000)]
        (path := tmp / f"truncated-{i}.jpg").write_bytes(data)
        files.append((path, "corrupt_image"))
    rng.shuffle(files)
    return files


class Chaos:
    """Runs SCHEDULE plus the kills for WINDOW_S (or until all is done, and at least until
    every event ran and every fault was lifted); records each fault. An event waits while a
    failover is open and failover.TAIL_S after it (a slow ingest must not push the next
    chunk's ingest, which needs Redis and PostgreSQL, into a window)."""

    def __init__(self, rig: Rig, rng: random.Random, chunks: list[Any], expected: dict[str, str]):
        self.rig, self.rng, self.chunks, self.expected = rig, rng, chunks, expected
        self.faults: list[dict[str, Any]] = []
        self.lifts: list[tuple[float, Callable[[], None]]] = []
        self.frozen: int | None = None
        self.spared = 0
        self.quiet_until = 0.0  # no event before (seconds into the run)
        # No SIGKILL before: the S3 SlowDown window measures the transient wait alone (a kill
        # there would add its photos' redeliveries to the window's deliveries per photo).
        self.no_kills_until = 0.0
        self.malformed: dict[str, str] = {}  # entry id -> shape (tests/test_entries.py)
        self.ingested = 0
        self.actions = Actions(rig, random.Random(SEED + 1))

    def ingest(self, chunk: list[tuple[Path, str]]) -> None:
        """Every other chunk goes through the bulk lane, for one of three tenants: both
        lanes are busy throughout."""
        self.ingested += 1
        lane = ("--lane", "bulk", "--tenant", f"t{self.ingested % 3}")
        options = lane if self.ingested % 2 else ()
        ids = self.rig.ingest([path for path, _ in chunk], *options)
        self.expected.update(zip(ids, (end for _, end in chunk), strict=True))

    def fault(self, kind: str, lift_at: float | None = None, lift: Any = None, **info: Any) -> None:
        self.faults.append(
            fault := {"kind": kind, "at": time.time(), "lifted": time.time(), **info}
        )

        def lifted() -> None:
            fault.update(lift() or {})
            fault["lifted"] = time.time()

        if lift_at is not None:
            self.lifts.append((lift_at, lifted))

    def run(self) -> float:
        t0, events, next_kill, next_check = time.monotonic(), list(SCHEDULE), 1.0, 0.0
        self.t0 = time.time()
        while (now := time.monotonic() - t0) < WINDOW_S or events or self.lifts:
            self.rig.tend()
            for item in [x for x in self.lifts if x[0] <= now]:
                self.lifts.remove(item)
                item[1]()
            if events and events[0][0] <= now and now >= self.quiet_until:
                self.inject(events.pop(0)[1], now)
            elif now >= next_kill:
                if now >= self.no_kills_until:
                    self.kill()
                next_kill = now + self.rng.uniform(1, 3)
            elif not events and not self.lifts and now >= next_check:
                if self.rig.unfinished() == 0:
                    break
                next_check = now + 1
            time.sleep(0.05)
        for _, lifted in self.lifts:
            lifted()
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL a random worker, sparing one that holds a photo on its last attempt (in
        PostgreSQL's count): a photo killed MAX_ATTEMPTS times is dead-lettered
        `attempts_exhausted` by design (the poison-photo rule), and that would be the rig's
        doing, not the worker's."""
        # one attempt of headroom: a worker may claim a photo between this query and the kill
        spare = self.rig.holding(int(SETTINGS["DARKROOM_MAX_ATTEMPTS"]) - 1) | {self.frozen}
        slot = self.rng.choice(range(self.rig.n_workers))
        if slot in spare:
            self.spared += 1
        else:
            self.fault("sigkill", slot=slot)
            self.rig.kill_worker(slot)

    def thaw(self, slot: int) -> None:
        self.rig.signal_worker(slot, signal.SIGCONT)
        self.frozen = None

    def inject(self, kind: str, now: float) -> None:
        rig = self.rig
        if kind == "ingest":
            self.ingest(self.chunks.pop(0))
        elif kind == "malformed":  # after the Redis restart, so their letters stay
            with rig.redis() as client:
                for shape, flat in SHAPES.items():
                    self.malformed[client.execute_command("XADD", STREAM, "*", *flat)] = shape
        elif kind == "sigstop":  # longer than the claim idle time: its entries get stolen
            self.frozen = slot = self.rng.randrange(rig.n_workers)
            rig.signal_worker(slot, signal.SIGSTOP)
            self.fault(kind, now + 5, lambda: self.thaw(slot), slot=slot)
        elif kind == "s3_pause":
            rig.s3_proxy.pause()
            self.fault(kind, now + 10, rig.s3_proxy.resume)
        elif kind == "pg_terminate":
            self.fault(kind, backends=rig.pg_terminate())
        elif kind == "pg_cut":
            self.fault(kind, connections=rig.pg_proxy.cut())
        elif kind == "redis_restart":
            self.fault(kind)
            rig.restart_redis(down_s=2.0)
            self.faults[-1]["lifted"] = time.time()
        elif kind in failover.FAILOVER_S:
            self.fail_over(kind, now)
        else:
            self.act(kind, now)

    def act(self, kind: str, now: float) -> None:
        if kind == "pause_lane":
            self.actions.pause("bulk", 4.0)
        elif kind == "pause_all":
            pause = self.actions.pause(None, None)
            self.lifts.append((now + 4, lambda: self.actions.resume(pause)))
        elif kind == "erase":
            self.actions.erase(self.expected)

    def fail_over(self, kind: str, now: float) -> None:
        """Open a failover window; note the extra deliveries (beyond each photo's first,
        SIGKILLs included) from its opening to failover.TAIL_S after its end."""
        before = self.rig.extra_deliveries()
        info = failover.open_window(self.rig, kind)
        lift_at = now + failover.FAILOVER_S[kind]
        self.quiet_until = lift_at + failover.TAIL_S
        if kind == "s3_slowdown":
            self.no_kills_until = self.quiet_until
        self.fault(kind, lift_at, lambda: failover.close_window(self.rig, kind), **info)
        fault = self.faults[-1]

        def tally() -> None:
            fault["extra_deliveries"] = self.rig.extra_deliveries() - before

        self.lifts.append((lift_at + failover.TAIL_S, tally))


def settle(rig: Rig) -> str:
    """With the faults over, wait until every photo is terminal and the group holds nothing."""
    deadline, last, changed = time.monotonic() + DRAIN_DEADLINE_S, None, time.monotonic()
    while (state := (rig.unfinished(), *rig.backlog())) != (0, 0, 0):
        rig.tend()
        if state != last:
            last, changed = state, time.monotonic()
        if time.monotonic() - changed > STALL_S or time.monotonic() > deadline:
            return f"gave up: (unfinished photos, stream length, pending) stuck at {state}"
        time.sleep(1)
    return "settled"


def missing_objects(rig: Rig, keys: list[str]) -> list[str]:
    def absent(key: str) -> bool:
        try:
            return not rig.s3.head_object(Bucket=BUCKET, Key=PREFIX + key)
        except botocore.exceptions.ClientError:
            return True

    with ThreadPoolExecutor(8) as pool:
        return [k for k, gone in zip(keys, pool.map(absent, keys), strict=True) if gone]


def worst_recovery(faults: list[dict[str, Any]], done: list[float]) -> dict[str, float | None]:
    """Per kind of fault, the longest wait for an entry done once it (and any fault
    overlapping it, such as a kill during the S3 pause) was lifted."""
    worst: dict[str, float] = {}
    for f in faults:
        start = f["lifted"]
        for g in faults:  # in order of injection
            start = g["lifted"] if g["at"] <= start < g["lifted"] else start
        i = bisect.bisect(done, start)
        gap = done[i] - start if i < len(done) else math.inf
        worst[f["kind"]] = max(worst.get(f["kind"], 0.0), gap)
    return {kind: None if gap == math.inf else round(gap, 2) for kind, gap in worst.items()}


def failover_figures(
    faults: list[dict[str, Any]], records: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per failover window: what it did, what it cost (failover.figures), SIGKILLs in it."""
    out = {}
    for f in faults:
        if f["kind"] in failover.FAILOVER_S:
            until = f["lifted"] + failover.TAIL_S
            kills = sum(g["kind"] == "sigkill" and f["at"] <= g["at"] <= until for g in faults)
            info = {k: v for k, v in f.items() if k not in ("kind", "at", "lifted")}
            out[f["kind"]] = info | {"sigkills": kills} | failover.figures(f, records, until)
    return out


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with Rig(tmp_path, SETTINGS) as rig:
        yield rig


OUTCOME_EVENT = {
    "processed": ["darkroom.photo.published"],
    "processing_failed": ["darkroom.photo.failed"],
}


def event_checks(rows: dict[str, Any], outbox: list[dict[str, Any]], relayed: list[Any],
                 restart: float) -> dict[str, list[Any]]:  # fmt: skip
    """Every terminal photo (an erased one: actions.py) has exactly one event of its outcome;
    every stream entry is a committed event (none before its commit); after the drain none
    is unpublished, and every one committed after the Redis wipe is on the stream (after
    dedupe on `id`, once)."""
    by_photo: dict[str, list[str]] = {}
    for event in outbox:
        by_photo.setdefault(event["photo_id"], []).append(event["type"])
    committed, on_stream = {e["id"] for e in outbox}, {e["id"] for e in relayed}
    # an erased photo may have two (its outcome's, then the erase's); a pause's is about none
    subjects = Counter((e["subject"], e["type"]) for e in {e["id"]: e for e in relayed}.values()
                       if e["subject"] != str(NO_PHOTO))  # fmt: skip
    return {
        "terminal photos without exactly one event of their outcome": [
            i for i, x in rows.items() if x["state"] != "erased"
            and by_photo.get(i, []) != OUTCOME_EVENT.get(x["state"], [])],
        "stream events that were never committed": sorted(on_stream - committed),
        "events never published": [e["id"] for e in outbox if e["published_at"] is None],
        "events committed after the Redis wipe missing from the stream": [
            e["id"] for e in outbox
            if e["created_at"].timestamp() > restart and e["id"] not in on_stream],
        "photos with two events of one type on the stream after dedupe on id": [
            i for (i, _), n in subjects.items() if n > 1],
    }  # fmt: skip


@pytest.mark.chaos
@pytest.mark.timeout(1200)
def test_no_photo_lost_or_looped_under_chaos(rig: Rig, tmp_path: Path) -> None:
    """Kills, a freeze, a Redis wipe, PG and S3 outages: every photo ends terminal, once, and
    every malformed entry of a burst is dead-lettered once."""
    started, rng = time.monotonic(), random.Random(SEED)
    files, expected = corpus(tmp_path, rng), {}
    n_chunks = sum(kind == "ingest" for _, kind in SCHEDULE)
    chaos = Chaos(rig, rng, [files[UPFRONT + i :: n_chunks] for i in range(n_chunks)], expected)
    for i in range(0, UPFRONT, CHUNK):
        chaos.ingest(files[i : min(i + CHUNK, UPFRONT)])
    for slot in range(rig.n_workers):
        rig.start_worker(slot)
    window_s = chaos.run()
    sql = "SELECT id::text, processed_at FROM photos WHERE processing_state = 'processed'"
    snapshot = {r["id"]: r["processed_at"] for r in rig.query(sql)}
    settled = settle(rig)
    stop_codes = rig.stop_workers(grace_s=20)
    (rig.logs / "drain.log").write_text(rig.cli("run", "--drain", direct=False).stderr)

    rows = {r["id"]: r for r in rig.query(
        "SELECT p.id::text, p.processing_state AS state, p.visibility, p.error_code, p.lane,"
        " p.processed_at, p.renditions, p.updated_at, p.original_key, j.state AS job,"
        " j.attempt, j.last_error"
        " FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id")}  # fmt: skip
    with rig.redis() as client:
        every_letter = [fields for _, fields in client.xrange(DEAD)]
        relayed = [json.loads(fields["event"]) for _, fields in client.xrange(EVENTS)]
    outbox = rig.query("SELECT event_id::text AS id, photo_id::text, type, created_at,"
                       " published_at FROM photo_events ORDER BY id")  # fmt: skip
    letters = [x for x in every_letter if x.get("source_id") not in chaos.malformed]
    bad = Counter((x["source_id"], x["error_code"], x["field_count"]) for x in every_letter
                  if x.get("source_id") in chaos.malformed)  # fmt: skip
    backlog, records = rig.backlog(), rig.log_records()
    events = Counter(x.get("event") for x in records)
    outcomes = Counter(x.get("outcome") for x in records if x.get("event") == "entry done")
    done = sorted(x["ts"] for x in records if x.get("event") == "entry done")
    processed = [x for x in rows.values() if x["state"] == "processed"]
    failed = {i: x["error_code"] for i, x in rows.items() if x["state"] == "processing_failed"}
    faults = Counter(f["kind"] for f in chaos.faults)
    keys = [r["key"] for x in processed for r in json.loads(x["renditions"] or "[]")]
    missing = missing_objects(rig, keys)  # before the erase checks' gc runs
    pauses, started_in_pause = chaos.actions.pause_figures()
    erased, erase_checks = chaos.actions.erase_checks(rows)
    figures = {
        "photos": len(expected),
        "undecodable": sum(e not in ("processed", "erased") for e in expected.values()),
        "photos_by_lane": dict(Counter(x["lane"] for x in rows.values())),
        "states": dict(Counter(f"{x['state']}/{x['visibility']}" for x in rows.values())),
        "faults": dict(faults), "kills_spared": chaos.spared,
        "pg_backends_terminated": sum(f.get("backends", 0) for f in chaos.faults),
        "pg_connections_cut": sum(f.get("connections", 0) for f in chaos.faults),
        "worker_self_exits": dict(Counter(str(c["tail"][-1:])[:200] for c in rig.crashes)),
        "worker_exit_codes_on_sigterm": stop_codes, "settle": settled,
        "deliveries_logged": outcomes.total() + events["attempt failed; will retry"]
        + events["photo failed; dead-lettered"],
        "attempts_sum": sum(x["attempt"] or 0 for x in rows.values()),
        "max_attempt": max((x["attempt"] or 0 for x in rows.values()), default=0),
        "outcomes": dict(outcomes), "duplicates_absorbed": outcomes["already"],
        "retries": events["attempt failed; will retry"],
        "requeued_by_sweeper": sum(x.get("count", 0) for x in records
                                   if x.get("event") == "swept lost photos back into the stream"),
        "dead_letters": len(letters), "malformed_entries": len(chaos.malformed),
        "malformed_dead_letters": bad.total(),
        "malformed_attempts": dict(Counter(x["attempts"] for x in every_letter
                                           if x.get("source_id") in chaos.malformed)),
        "renditions_checked": len(keys),
        "worst_recovery_s": worst_recovery(chaos.faults, done),
        "longest_gap_between_entries_done_s": round(max((b - a for a, b in pairwise(done)),
                                                        default=0), 2),
        "failovers": failover_figures(chaos.faults, records),
        "events": {"in_postgresql": len(outbox), "stream_entries": len(relayed),
                   "sent_again": len(relayed) - len({e["id"] for e in relayed})},
        "pauses": pauses, "erased": erased,
        "chaos_window_s": round(window_s, 1), "wall_s": round(time.monotonic() - started, 1),
        "logs": str(rig.logs),
    }  # fmt: skip
    timeline = [f | {k: round(f[k] - chaos.t0, 2) for k in ("at", "lifted")} for f in chaos.faults]
    (tmp_path / "figures.json").write_text(json.dumps(figures | {"faults_timeline": timeline},
                                                      indent=2, default=str))  # fmt: skip
    print("\nchaos figures:\n" + json.dumps(figures, indent=2, default=str))

    def show(x: Any) -> str:
        if not (isinstance(x, str) and x in expected):
            return repr(x)
        row = rows.get(x) or {}
        error = f"{row.get('error_code')}: {(row.get('last_error') or '')[:150]}"
        job = f"job {row.get('job')}, attempt {row.get('attempt')}"
        return f"{x} expected {expected[x]}, is {row.get('state')} ({job}, {error})"

    # Dead letters: a Redis restart wipes the letters written before it, so the rule is:
    # every letter present names a failed photo with the same code, one letter per photo,
    # and every photo whose failure was committed after Redis came back has its letter.
    restart = max((f["lifted"] for f in chaos.faults if f["kind"] == "redis_restart"), default=0)
    lettered = Counter(x.get("photo_id") for x in letters)
    final = {x["id"]: x["processed_at"] for x in processed}
    ok = {("processed", "published"), ("processing_failed", "unpublished")}
    slowdown = figures["failovers"].get("s3_slowdown", {})
    published = Counter(x.get("photo_id") for x in records if x.get("outcome") == "published")
    checks = event_checks(rows, outbox, relayed, restart) | {
        "rig: fault kinds never injected": sorted(FAULT_KINDS - set(faults)),
        "photos lost (not terminal)": [i for i in expected if (rows.get(i, {}).get("state"),
                                       rows.get(i, {}).get("visibility")) not in ok
                                       and expected[i] != "erased"],
        "renditions of processed photos missing in S3": missing,
        "photos of a paused scope started in its window (after its commit)": started_in_pause,
        "dead letters not matching a failed photo and its code": [
            x for x in letters if failed.get(x.get("photo_id")) != x.get("error_code")],
        "photos dead-lettered more than once": [i for i, n in lettered.items() if n > 1],
        "dead letters not naming their photo's lane": [
            x for x in letters if x.get("lane") != rows.get(x.get("photo_id"), {}).get("lane")],
        "photos failed after the Redis restart without a dead letter": [i for i in failed
            if i not in lettered and rows[i]["updated_at"].timestamp() > restart],
        "photos failed other than expected (a valid photo failed, or a wrong code)": [
            i for i, code in failed.items() if expected.get(i) != code],
        "undecodable photos that did not fail": [
            i for i, e in expected.items() if e not in ("processed", "erased") and i not in failed],
        "work stream (length, pending) after the drain": [] if backlog == (0, 0) else [backlog],
        "processed_at changed after the chaos window": [
            i for i, at in snapshot.items() if final.get(i) != at],
        "S3 SlowDown window: storage retries or dead letters": [
            f"{what} {code}" for what in ("retries_logged", "dead_lettered")
            for code in slowdown.get(what, {}) if code == "storage_unavailable"],
        "S3 SlowDown window: deliveries per photo over the bound": [] if (
            slowdown.get("deliveries_logged", 0)
            <= SLOWDOWN_DELIVERIES_PER_PHOTO * slowdown.get("photos_logged", 0)) else [
            f"{slowdown.get('deliveries_logged')} deliveries for"
            f" {slowdown.get('photos_logged')} photos"],
        "photos logged as published more than once": [i for i, n in published.items() if n > 1],
        "rig: malformed entries not all sent": [] if len(chaos.malformed) == len(SHAPES) else
            [len(chaos.malformed)],
        "malformed entries not dead-lettered exactly once as bad_message with their field count": [
            shape for entry, shape in chaos.malformed.items()
            if bad[(entry, "bad_message", str(len(SHAPES[shape]) // 2))] != 1
            or sum(n for (e, _, _), n in bad.items() if e == entry) != 1],
    } | erase_checks  # fmt: skip
    problems = [f"{what}: {len(found)}, e.g. " + "; ".join(map(show, found[:5]))
                for what, found in checks.items() if found]  # fmt: skip
    assert not problems, "\n".join(problems) + "\nfigures: " + json.dumps(figures, default=str)
