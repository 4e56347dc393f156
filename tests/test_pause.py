"""Pause and resume end to end, through the CLI and real worker processes: a paused lane or
tenant starts nothing new while the rest runs on, a pause outlives a worker's restart, a
timed one ends by itself, no pause costs a photo an attempt, and status, events and the
audit trail say who paused what, why and until when."""

from __future__ import annotations

import json
import subprocess
import uuid

from tests.conftest import PHOTOS, Env
from tests.test_lanes_e2e import BULK_PHOTOS, ingest
from tests.test_recovery import wait_for

PROCESSED = "SELECT 1 FROM photos WHERE id = ANY($1::uuid[]) HAVING count(*) FILTER"
# Claims come back quickly once a scope is resumed (an entry left pending is looked at again
# once idle this long).
QUICK = {"DARKROOM_CLAIM_IDLE_MS": "2000", "DARKROOM_OPERATOR": "alice"}


def all_processed(env: Env, ids: list[uuid.UUID], proc: subprocess.Popen[str]) -> None:
    sql = f"{PROCESSED} (WHERE processing_state = 'processed') = cardinality($1::uuid[])"
    wait_for(env, sql, ids, proc=proc)


def attempts(env: Env, ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    rows = env.query(
        "SELECT p.id, coalesce(j.attempt, 0) AS attempt FROM photos p LEFT JOIN photo_jobs j"
        " ON j.photo_id = p.id WHERE p.id = ANY($1::uuid[])",
        ids,
    )
    return {r["id"]: r["attempt"] for r in rows}


def stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    return proc.communicate(timeout=60)[1]


def test_a_paused_bulk_lane_starts_nothing_while_uploads_run_then_finishes_on_resume(
    file_env: Env,
) -> None:
    """Bulk paused: uploads are rendered and no bulk photo is claimed; once resumed every
    bulk photo is processed on its first attempt."""
    file_env.cli("pause", "--lane", "bulk", "--reason", "library import on hold", **QUICK)
    bulk = ingest(file_env, BULK_PHOTOS, "--lane", "bulk", "--tenant", "library")
    worker = file_env.start("run", **QUICK)
    uploads = ingest(file_env, [PHOTOS / "4.webp", PHOTOS / "4.webp"])
    all_processed(file_env, uploads, worker)
    assert set(attempts(file_env, bulk).values()) == {0}, "a paused bulk photo was claimed"
    assert file_env.redis.xlen(f"{file_env.stream}:bulk") == 0, "the feeder fed a paused lane"
    file_env.cli("resume", "--lane", "bulk", **QUICK)
    all_processed(file_env, bulk, worker)
    assert set(attempts(file_env, bulk).values()) == {1}, "the pause cost an attempt"
    stop(worker)


def test_a_pause_while_a_worker_renders_stops_new_claims_from_its_commit(file_env: Env) -> None:
    """Bulk paused mid-backlog: the photo in progress finishes, no bulk photo is claimed
    after the pause committed (PostgreSQL's clock), uploads still run, and resume ends it."""
    bulk = ingest(file_env, BULK_PHOTOS, "--lane", "bulk", "--tenant", "library")
    worker = file_env.start("run", DARKROOM_CONCURRENCY="1", **QUICK)
    wait_for(file_env, "SELECT 1 FROM photo_jobs WHERE state = 'active'", proc=worker)
    file_env.cli("pause", "--lane", "bulk", "--reason", "mid-backlog", **QUICK)
    [committed] = file_env.query("SELECT now() AS at")
    uploads = ingest(file_env, [PHOTOS / "4.webp"])
    all_processed(file_env, uploads, worker)
    late = file_env.query(
        "SELECT photo_id FROM photo_jobs j JOIN photos p ON p.id = j.photo_id"
        " WHERE p.lane = 'bulk' AND j.started_at > $1",
        committed["at"],
    )
    assert not late, f"bulk photos claimed after the pause committed: {late}"
    left = [p for p, n in attempts(file_env, bulk).items() if n == 0]
    assert left, "the backlog ran out before the pause: nothing to show"
    file_env.cli("resume", **QUICK)
    all_processed(file_env, bulk, worker)
    assert set(attempts(file_env, bulk).values()) == {1}
    stop(worker)


def test_a_paused_tenant_survives_a_worker_restart_and_a_timed_pause_ends_by_itself(
    file_env: Env,
) -> None:
    """acme paused: its upload waits, unclaimed, through a worker's kill and a new worker,
    while another tenant's uploads are processed; paused again `--for 1s`, it is processed
    once that ran out, on its first attempt, with no dead letter."""
    file_env.cli("pause", "--tenant", "acme", "--reason", "acme's quota", **QUICK)
    [held] = ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "acme")
    first = file_env.start("run", **QUICK)
    all_processed(file_env, ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "zed"), first)
    first.kill()
    first.communicate()
    second = file_env.start("run", **QUICK)
    all_processed(file_env, ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "zed"), second)
    assert attempts(file_env, [held]) == {held: 0}, "a paused tenant's photo was claimed"
    file_env.cli("pause", "--tenant", "acme", "--reason", "one more second", "--for", "1s",
                 **QUICK)  # fmt: skip
    all_processed(file_env, [held], second)
    assert attempts(file_env, [held]) == {held: 1}
    assert file_env.redis.xlen(file_env.dead) == 0
    stop(second)


def test_status_events_and_audit_say_who_paused_what_why_and_until_when(file_env: Env) -> None:
    """status (text and JSON), the events stream and the audit trail show the pause and
    its resume; status prints a dash, not None, for a lane with nothing waiting."""
    file_env.cli("migrate")
    file_env.cli("pause", "--lane", "bulk", "--tenant", "acme", "--reason", "quota",
                 "--for", "2h", **QUICK)  # fmt: skip
    text = file_env.cli("status").stdout
    assert "lane=bulk tenant=acme  by alice" in text and "reason: quota" in text
    assert "oldest_wait_s=None" not in text and "oldest_wait_s=-" in text
    [pause] = json.loads(file_env.cli("status", "--json").stdout)["pauses"]
    assert (pause["lane"], pause["tenant"], pause["operator"]) == ("bulk", "acme", "alice")
    assert pause["until"] is not None
    file_env.cli("resume", "--tenant", "acme", "--reason", "paid", **QUICK)
    assert "nothing" in file_env.cli("status").stdout.split("paused (")[1].split("consumers")[0]
    events = [json.loads(line) for line in file_env.cli("events", "--json").stdout.splitlines()]
    assert [e["type"] for e in events] == ["darkroom.queue.paused", "darkroom.queue.resumed"]
    assert events[0]["data"]["reason"] == "quota" and events[1]["data"]["resumed_by"] == "alice"
    trail = json.loads(file_env.cli("audit", "--json").stdout)
    assert [(r["action"], r["count"], r["reason"]) for r in trail] == [
        ("resume", 1, "paid"), ("pause", 1, "quota")]  # fmt: skip


def test_a_bad_duration_or_a_missing_reason_is_a_usage_error(file_env: Env) -> None:
    """`--for 3x` and a pause without --reason exit 2 before anything is paused."""
    assert file_env.cli("pause", "--reason", "x", "--for", "3x", check=False).returncode == 2
    assert file_env.cli("pause", "--lane", "bulk", check=False).returncode == 2
