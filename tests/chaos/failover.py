"""Failover windows for the chaos runs: Redis demoted to a replica (writes answer READONLY),
PostgreSQL turned read-only, S3 denying every request (403 AccessDenied), S3 throttling the
rendition uploads (503 SlowDown on `renditions/`, while the probe passes). Each is opened
and closed on a Rig; `figures` says what a window cost, from the workers' JSON logs."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from tests.chaos.rig import Rig

# How long each window stays open, in seconds.
FAILOVER_S = {"redis_replica": 10.0, "pg_read_only": 30.0, "s3_denied": 20.0,
              "s3_slowdown": 15.0}  # fmt: skip
# Failures logged this long after a window closed still count as its cost (a failure record
# can only be written once the dependency is back).
TAIL_S = 5.0
RETRY, DEAD_LETTERED = "attempt failed; will retry", "photo failed; dead-lettered"
DELIVERY_EVENTS = ("entry done", RETRY, DEAD_LETTERED)
TRANSIENT_WAIT = "transient error; waiting in place"


def renditions_put(method: str, path: str) -> bool:
    return method == "PUT" and "/renditions/" in path and ".darkroom-probe" not in path


def open_window(rig: Rig, kind: str) -> dict[str, Any]:
    """Start the fault; what it did (backends terminated, ...)."""
    if kind == "redis_replica":
        rig.demote_redis()
        # read after the demotion: from here no write lands (an ack just before it would
        # change the stream between an earlier reading and the demotion)
        return {"backlog_at_demotion": rig.backlog()}
    if kind == "pg_read_only":
        return {"backends_terminated": rig.pg_read_only(True)}
    if kind == "s3_denied":
        rig.s3_proxy.denied = 0
        rig.s3_proxy.deny(True)
        return {}
    if kind == "s3_slowdown":
        rig.s3_faults.denied = 0
        rig.s3_faults.throttle(renditions_put)
        return {}
    raise ValueError(kind)


def close_window(rig: Rig, kind: str) -> dict[str, Any]:
    """Lift the fault; what it saw while open."""
    if kind == "redis_replica":  # a replica takes no write: its stream must be unchanged
        with rig.redis() as client:
            role = client.role()[0]
        backlog = rig.backlog()
        rig.promote_redis()
        return {"role_before_lift": role, "backlog_at_promotion": backlog}
    if kind == "pg_read_only":
        return {"backends_terminated_at_lift": rig.pg_read_only(False)}
    if kind == "s3_denied":
        rig.s3_proxy.deny(False)
        return {"requests_denied": rig.s3_proxy.denied}
    if kind == "s3_slowdown":
        rig.s3_faults.throttle(lambda method, path: False)
        return {"requests_throttled": rig.s3_faults.denied}
    raise ValueError(kind)


def figures(window: dict[str, Any], records: list[dict[str, Any]], until: float) -> dict[str, Any]:
    """What the window `window` ({"at", "lifted"} in epoch seconds) cost: the workers' log
    lines while it was open (and their most frequent kinds: the evidence of a loop), the
    retries and dead letters logged until `until`, the wait for the next finished photo."""
    at, lifted = window["at"], window["lifted"]
    inside = [x for x in records if at <= x["ts"] <= lifted]
    after = [x for x in records if at <= x["ts"] <= until]
    done = sorted(x["ts"] for x in records if x.get("event") == "entry done")
    i = bisect.bisect(done, lifted)
    deliveries = [x for x in after if x.get("event") in DELIVERY_EVENTS]
    kinds = Counter(
        f"{x.get('level')} {x.get('event')} [{x.get('error_code') or x.get('dependency') or ''}]"
        for x in inside
    )
    return {
        "seconds": round(lifted - at, 1),
        "log_lines": len(inside),
        "log_lines_per_s": round(len(inside) / max(lifted - at, 1e-9), 1),
        "top_log_lines": dict(kinds.most_common(6)),
        "retries_logged": dict(
            Counter(x.get("error_code") for x in after if x.get("event") == RETRY)
        ),
        "dead_lettered": dict(
            Counter(x.get("error_code") for x in after if x.get("event") == DEAD_LETTERED)
        ),
        "transient_waits_logged": dict(
            Counter(x.get("error_code") for x in after if x.get("event") == TRANSIENT_WAIT)
        ),
        "entries_done_inside": sum(at <= t <= lifted for t in done),
        # every delivery that ended (a SIGKILLed one is not logged: its redelivery is)
        "deliveries_logged": len(deliveries),
        "photos_logged": len({x.get("photo_id") for x in deliveries}),
        "recovery_s": round(done[i] - lifted, 2) if i < len(done) else None,
    }
