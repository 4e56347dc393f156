"""Failover test of "A fault of the deployment is an outage, never the photo's fault": Redis
demoted to a replica, PostgreSQL read-only and S3 denying everything, one after the other
while 2 workers process 160 valid photos. Every photo ends processed, none is dead-lettered,
the failovers cost few deliveries, none is taken for a bug (`internal_error`) or kills a
worker, and a worker facing READONLY does not spin."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from darkroom.store import db, probe
from tests.chaos import failover
from tests.chaos.rig import DEAD, Rig
from tests.chaos.test_chaos import SETTINGS, VALID, missing_objects, settle
from tests.conftest import PHOTOS

WORKERS, PHOTOS_N, UPFRONT = 2, 160, 16
ORDER = ("redis_replica", "pg_read_only", "s3_denied")
# Healthy seconds before each window: more than the gate's longest wait between probes
# (10 s), so each window meets workers that saw the previous one end.
GAP_S = 12.0
# The failover bounds: deliveries ≤ photos + 10 %; log lines while Redis is a replica (2 workers,
# 10 s), where the unfixed worker wrote ~10^5 lines in a hot loop.
MAX_DELIVERIES = PHOTOS_N + PHOTOS_N // 10
MAX_LOG_LINES_REDIS_WINDOW = 200
# Probes right after pg_terminate_backend, after these delays: at ~0.5–1 ms asyncpg has
# read the FATAL but not the EOF, and the race shows nearly every time here.
TERMINATE_TRIALS, TERMINATE_DELAYS_S = 30, (0.0, 0.0005, 0.001)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with Rig(tmp_path, SETTINGS, workers=WORKERS) as rig:
        yield rig


def wait(rig: Rig, seconds: float) -> None:
    """Sleep, restarting workers that exit by themselves (a container restart policy)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rig.tend()
        time.sleep(0.1)


def run_windows(rig: Rig, chunks: list[list[Path]], expected: set[str]) -> list[dict[str, Any]]:
    """Before each window: a healthy gap, then a chunk ingested so the window meets a backlog."""
    windows: list[dict[str, Any]] = []
    for kind, chunk in zip(ORDER, chunks, strict=True):
        wait(rig, GAP_S)
        expected.update(rig.ingest(chunk))
        window: dict[str, Any] = {"kind": kind, "extra_deliveries_before": rig.extra_deliveries()}
        window |= {"cpu_before": rig.worker_cpu_s(), "at": time.time()}
        window |= failover.open_window(rig, kind)
        wait(rig, failover.FAILOVER_S[kind])
        window |= {"cpu_s": round(rig.worker_cpu_s() - window.pop("cpu_before"), 2)}
        window |= failover.close_window(rig, kind) | {"lifted": time.time()}
        windows.append(window)
    wait(rig, GAP_S)
    return windows


def window_figures(
    windows: list[dict[str, Any]], records: list[dict[str, Any]], settled_extra: int
) -> dict[str, Any]:
    """Each window's figures; its deliveries cost is the extra deliveries (beyond a photo's
    first) counted from its opening to the next window's opening, or to the end; its
    retries and dead letters are counted until GAP_S after it."""
    ends = [w["extra_deliveries_before"] for w in windows[1:]] + [settled_extra]
    out = {}
    for w, end in zip(windows, ends, strict=True):
        until = w["lifted"] + GAP_S
        info = {k: v for k, v in w.items() if k not in ("kind", "at", "lifted")}
        info["extra_deliveries"] = end - info.pop("extra_deliveries_before")
        out[w["kind"]] = info | failover.figures(w, records, until)
    return out


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_failovers_cost_the_photos_nothing(rig: Rig) -> None:
    """READONLY Redis 10 s, read-only PostgreSQL 30 s, S3 403 20 s: all processed, none
    dead-lettered, deliveries ≤ photos + 10 %, and no log storm while Redis is a replica."""
    started = time.monotonic()
    files = [PHOTOS / VALID[i % len(VALID)] for i in range(PHOTOS_N)]
    size = (PHOTOS_N - UPFRONT) // len(ORDER)
    chunks = [files[UPFRONT + i * size : UPFRONT + (i + 1) * size] for i in range(len(ORDER))]
    expected = set(rig.ingest(files[:UPFRONT]))
    for slot in range(WORKERS):
        rig.start_worker(slot)
    windows = run_windows(rig, chunks, expected)
    settled = settle(rig)
    stop_codes = rig.stop_workers(grace_s=20)

    rows = rig.query(
        "SELECT p.id::text, p.processing_state AS state, p.visibility, p.error_code,"
        " p.renditions, j.attempt, j.error_code AS job_error, j.last_error"
        " FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id"
    )
    with rig.redis() as client:
        letters = [fields for _, fields in client.xrange(DEAD)]
    records = rig.log_records()
    # A fault of the deployment is an outage, never a bug: nothing logged as internal_error.
    bugs = [x for x in records if x.get("error_code") == "internal_error"
            or x.get("event") == "unexpected error"]  # fmt: skip
    per_window = window_figures(windows, records, rig.extra_deliveries())
    done = [x for x in rows if (x["state"], x["visibility"]) == ("processed", "published")]
    keys = [r["key"] for x in done for r in json.loads(x["renditions"] or "[]")]
    deliveries = sum(x["attempt"] or 0 for x in rows)
    figures = {
        "photos": len(expected), "workers": WORKERS,
        "states": dict(Counter(f"{x['state']}/{x['visibility']}" for x in rows)),
        "deliveries (sum of photo_jobs.attempt)": deliveries,
        "deliveries bound": MAX_DELIVERIES,
        "max_attempt": max((x["attempt"] or 0 for x in rows), default=0),
        "dead_letters": len(letters),
        "dead_letter_codes": dict(Counter(x.get("error_code") for x in letters)),
        "windows": per_window,
        "worker_log_lines": len(records), "worker_self_exits": len(rig.crashes),
        "internal_errors_logged": len(bugs),
        "worker_exit_codes_on_sigterm": stop_codes, "settle": settled,
        "backlog (stream length, pending)": rig.backlog(),
        "wall_s": round(time.monotonic() - started, 1), "logs": str(rig.logs),
    }  # fmt: skip
    print("\nfailover figures:\n" + json.dumps(figures, indent=2, default=str))

    redis_lines = per_window["redis_replica"]["log_lines"]
    checks = {
        "photos not processed": [
            f"{x['id']} {x['state']} attempt {x['attempt']} {x['job_error']}: "
            f"{(x['last_error'] or '')[:160]}"
            for x in rows
            if (x["state"], x["visibility"]) != ("processed", "published")
        ],
        "dead letters": [f"{x.get('photo_id')} {x.get('error_code')}" for x in letters],
        "renditions missing in S3": missing_objects(rig, keys),
        f"deliveries above {MAX_DELIVERIES}": [deliveries] if deliveries > MAX_DELIVERIES else [],
        f"log lines while Redis was a replica above {MAX_LOG_LINES_REDIS_WINDOW}": (
            [redis_lines] if redis_lines > MAX_LOG_LINES_REDIS_WINDOW else []
        ),
        "worker log lines of an internal_error (a fault taken for a bug)": [
            f"{x['timestamp']} {x['event']}: {x.get('error') or x.get('exception', '')[-160:]}"
            for x in bugs
        ],
        "workers that exited by themselves": [
            f"{c['log']} rc {c['rc']}: {c['tail'][-1:]}" for c in rig.crashes
        ],
        "rig: S3 denied no request": [] if per_window["s3_denied"]["requests_denied"] else [0],
        "rig: Redis was not a replica": [
            r for r in [per_window["redis_replica"]["role_before_lift"]] if r != "slave"
        ],
        "rig: the replica's stream (length, pending) changed": [
            (w["backlog_at_demotion"], w["backlog_at_promotion"])
            for w in [per_window["redis_replica"]]
            if w["backlog_at_demotion"] != w["backlog_at_promotion"]
        ],
        "work stream (length, pending) left": [] if rig.backlog() == (0, 0) else [rig.backlog()],
    }
    problems = [
        f"{what}: {len(found)}, e.g. " + "; ".join(map(str, found[:5]))
        for what, found in checks.items()
        if found
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.chaos
@pytest.mark.timeout(120)
async def test_a_terminated_connection_is_an_outage(database_url: str) -> None:
    """A query right after `pg_terminate_backend` of its pooled connection fails as
    `database_unavailable` (an outage), never as a raw driver error: asyncpg may raise
    InternalClientError "another operation is in progress" (it got the FATAL, not yet the
    EOF), which the chaos runs saw kill a worker's sweep and turn a publish into a bug."""
    pool = await db.connect(database_url, 1)
    admin = await asyncpg.connect(database_url.rsplit("/", 1)[0] + "/postgres")
    seen: Counter[str] = Counter()
    try:
        for i in range(TERMINATE_TRIALS):
            await _healthy(pool)  # a connection to kill
            pid = await pool.fetchval("SELECT pg_backend_pid()")
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            await anyio.sleep(TERMINATE_DELAYS_S[i % len(TERMINATE_DELAYS_S)])
            try:
                await probe.check(pool)
                seen["answered"] += 1
            except Exception as exc:
                seen[f"{type(exc).__name__}: {str(exc)[:70]}"] += 1
    finally:
        await admin.close()
        await pool.close()
    print(f"\nright after pg_terminate_backend, {TERMINATE_TRIALS} probes: {dict(seen)}")
    raw = {k: n for k, n in seen.items() if k != "answered" and "DatabaseUnavailable" not in k}
    assert not raw, f"driver errors not translated to an outage: {raw}"


async def _healthy(pool: db.Pool) -> None:
    """Wait until the pool answers a probe again (it replaces a dead connection on use)."""
    for _ in range(200):
        with contextlib.suppress(Exception):
            await probe.check(pool)
            return
        await anyio.sleep(0.05)
    raise AssertionError("the database did not answer a probe for 10 s")
