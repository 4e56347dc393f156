"""Errors of the deployment, not of a photo, through the real CLI: a role short of one grant,
a grant revoked mid-run, a column dropped mid-run. Each is an outage (/readyz 503 naming
it, a line a minute at most), never an attempt, and `run --drain` gives up on it in time."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from tests.conftest import PHOTOS, Env, free_port
from tests.faults import pg_admin
from tests.test_failover import readyz, wait_down
from tests.test_recovery import log_lines, wait_for

BATCH = sorted(PHOTOS.glob("Landscape_*.jpg")) * 2
DRAIN_BOUND_S = 60


def db_run(env: Env, sql: str) -> None:
    """One statement as the test database's owner (a grant, a dropped column)."""
    owner = re.sub(r"//[^@/]+@", "//postgres@", env.database_url)

    async def go() -> None:
        conn = await asyncpg.connect(owner)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(go())


@pytest.fixture
def role(file_env: Env) -> Iterator[str]:
    """A login role with every grant on darkroom's tables and sequences."""
    name = f"darkroom_r_{uuid.uuid4().hex[:8]}"
    asyncio.run(pg_admin(f"CREATE ROLE {name} LOGIN"))
    db_run(file_env, f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {name};"
                     f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {name}")  # fmt: skip
    file_env.vars["DARKROOM_DATABASE_URL"] = file_env.database_url.replace("postgres@", f"{name}@")
    yield name
    file_env.kill_workers()
    file_env.vars["DARKROOM_DATABASE_URL"] = file_env.database_url.replace(f"{name}@", "postgres@")
    db_run(file_env, f"DROP OWNED BY {name}")
    asyncio.run(pg_admin(f"DROP ROLE {name}"))


def attempts(env: Env) -> dict[str, int]:
    """Each photo's state: `processed` ones with their attempt, others with theirs or 0."""
    rows = env.query("SELECT p.processing_state AS s, coalesce(j.attempt, 0) AS a FROM photos p"
                     " LEFT JOIN photo_jobs j ON j.photo_id = p.id")  # fmt: skip
    seen: dict[str, int] = {}
    for r in rows:
        key = f"{r['s']} attempt {r['a']}"
        seen[key] = seen.get(key, 0) + 1
    return seen


def drain_in_outage(env: Env, port: int, break_it: str) -> tuple[str, str]:
    """Start `run --drain`, let one photo publish, break the deployment with `break_it`:
    the drain must exit 3 within DRAIN_BOUND_S. What /readyz said, and the worker's stderr."""
    worker = env.start("run", "--drain", DARKROOM_METRICS_PORT=str(port),
                       DARKROOM_CONCURRENCY="1", DARKROOM_CONSUMER="w1")  # fmt: skip
    wait_for(env, "SELECT 1 FROM photos WHERE processing_state = 'processed'", proc=worker)
    db_run(env, break_it)
    broken_at = time.monotonic()
    said = wait_down(port, "database", worker)
    try:
        stderr = worker.communicate(timeout=DRAIN_BOUND_S)[1]
    except subprocess.TimeoutExpired:
        worker.kill()
        raise AssertionError(f"`run --drain` still running {DRAIN_BOUND_S} s on") from None
    took_s = time.monotonic() - broken_at
    assert worker.returncode == 3, stderr
    assert took_s < DRAIN_BOUND_S, f"{took_s:.0f} s"
    return said, stderr


def failure_lines(stderr: str, words: str) -> list[dict[str, Any]]:
    """Warnings and errors naming the failure, up to the drain's own stop."""
    lines = []
    for line in log_lines(stderr):
        if line["event"].startswith("outage outlasted the drain"):
            break
        if line.get("level") in ("warning", "error") and words in str(line):
            lines.append(line)
    return lines


def test_a_role_without_insert_on_photo_jobs_is_refused_by_the_probe(
    file_env: Env, role: str
) -> None:
    """Every grant is checked on its own: a role with SELECT and UPDATE but not INSERT on
    photo_jobs is refused at start, /readyz naming the grant, and no photo is touched."""
    file_env.ingest(BATCH[:2])
    db_run(file_env, f"REVOKE INSERT ON photo_jobs FROM {role}")
    port = free_port()
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port))
    said = wait_down(port, "database", worker)
    assert said.startswith("permission_denied") and "INSERT on photo_jobs" in said, said
    assert readyz(port)[0] == 503
    worker.send_signal(signal.SIGTERM)
    stderr = worker.communicate(timeout=60)[1]
    assert worker.returncode == 0, stderr
    assert attempts(file_env) == {"uploaded attempt 0": 2}
    assert "stopping during an outage" not in stderr


def test_a_grant_revoked_mid_run_is_an_outage_and_ends_the_drain(file_env: Env, role: str) -> None:
    """INSERT on photo_attempts revoked mid-drain: no attempt burned, /readyz 503 naming
    the grant, at most one line about it a minute, `run --drain` exits 3 within 60 s
    saying why; once granted again every photo publishes on attempt 1."""
    file_env.ingest(BATCH)
    port = free_port()
    said, stderr = drain_in_outage(file_env, port, f"REVOKE INSERT ON photo_attempts FROM {role}")
    assert said.startswith("permission_denied") and "INSERT on photo_attempts" in said, said
    assert "darkroom: drain incomplete: database down for" in stderr
    assert "INSERT on photo_attempts" in stderr.splitlines()[-1]
    assert len(failure_lines(stderr, "permission_denied")) <= 1, stderr
    assert "attempt failed" not in stderr and "dead-lettered" not in stderr
    assert all(k.endswith("attempt 1") or k.endswith("attempt 0") for k in attempts(file_env))
    db_run(file_env, f"GRANT INSERT ON photo_attempts TO {role}")
    file_env.cli("run", "--drain", DARKROOM_CONSUMER="w1")
    assert attempts(file_env) == {"processed attempt 1": len(BATCH)}


def test_a_column_dropped_mid_run_is_an_outage_and_ends_the_drain(file_env: Env) -> None:
    """A schema older than the code (a column the claim writes dropped mid-drain):
    schema_mismatch on /readyz naming a statement and the column, no attempt burned, a line
    a minute at most, `run --drain` exits 3 within 60 s."""
    file_env.ingest(BATCH)
    port = free_port()
    said, stderr = drain_in_outage(file_env, port, "ALTER TABLE photo_attempts DROP COLUMN lane")
    # the first statement the probe finds broken (one of CLAIM_SQL, history.RECORD_SQL, ...)
    assert said.startswith("schema_mismatch") and "_SQL:" in said and '"lane"' in said, said
    assert "darkroom: drain incomplete: database down for" in stderr
    assert len(failure_lines(stderr, "schema_mismatch")) <= 1, stderr
    assert "attempt failed" not in stderr and "dead-lettered" not in stderr
    assert all(k.endswith("attempt 1") or k.endswith("attempt 0") for k in attempts(file_env))
    assert file_env.redis.xlen(file_env.dead) == 0


def test_a_grant_lost_while_recording_failures_is_an_outage(file_env: Env, role: str) -> None:
    """Photos that fail for good while INSERT on photo_events is revoked: their failure
    cannot be recorded (its event is in the same statement). That is the deployment's
    fault, so the gate declares it (/readyz names the grant, intake pauses) instead of the
    entries being reclaimed for ever; no photo is failed or dead-lettered meanwhile."""
    port = free_port()
    file_env.ingest([PHOTOS / "4.webp"])
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port), DARKROOM_CONSUMER="w1")
    wait_for(file_env, "SELECT 1 FROM photos WHERE processing_state = 'processed'", proc=worker)
    db_run(file_env, f"REVOKE INSERT ON photo_events FROM {role}")
    broken = []
    for n in range(4):
        path = file_env.tmp / f"broken-{n}.jpg"
        path.write_bytes(b"\xff\xd8\xff\xe0 not a JPEG after all " + bytes([n]) * 64)
        broken.append(path)
    file_env.ingest(broken)
    said = wait_down(port, "database", worker)
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    assert said.startswith("permission_denied") and "INSERT on photo_events" in said, said
    assert file_env.query("SELECT 1 FROM photos WHERE processing_state = 'processing_failed'") == []
    assert file_env.redis.xlen(file_env.dead) == 0
