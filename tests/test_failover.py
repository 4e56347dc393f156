"""Failovers through the real CLI: Redis demoted to a replica, PostgreSQL turned read-only,
S3 denying every request. Each pauses the worker (/readyz says which and why) without a
hot loop, and once it ends every photo is published on its first delivery."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import PHOTOS, Env, free_port
from tests.faults import DenyingS3Proxy, pg_admin, spare_redis
from tests.test_recovery import log_lines, state, wait_for

BATCH = sorted(PHOTOS.glob("Landscape_*.jpg"))


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def wait_down(port: int, dependency: str, worker: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 90
    while True:
        status, body = readyz(port)
        if status == 503 and dependency in body.get("down", {}):
            return str(body["down"][dependency])
        assert time.monotonic() < deadline, f"/readyz never named {dependency} as down"
        assert worker.poll() is None, worker.communicate()[1]
        time.sleep(0.1)


def finish(env: Env, worker: subprocess.Popen[str], ids: list[uuid.UUID]) -> str:
    wait_for(env, "SELECT 1 FROM photos HAVING bool_and(processing_state = 'processed')",
             proc=worker)  # fmt: skip
    worker.send_signal(signal.SIGTERM)
    stderr = worker.communicate(timeout=60)[1]
    assert worker.returncode == 0, stderr
    assert {state(env, i) for i in ids} == {("processed", "published", 1)}, stderr
    assert "attempt failed; will retry" not in stderr
    return stderr


@pytest.fixture
def spare(tmp_path: Path) -> Iterator[int]:
    yield from spare_redis(tmp_path)


def test_redis_demoted_to_replica_pauses_without_a_hot_loop(file_env: Env, spare: int) -> None:
    """A failover leaves the worker on a replica (READONLY, PING fine): it pauses, /readyz
    says queue read_only, it logs a handful of lines (not one per turn), and resumes."""
    file_env.vars["DARKROOM_REDIS_URL"] = f"redis://127.0.0.1:{spare}/0"
    ids = file_env.ingest(BATCH)
    admin, port = redis.Redis(port=spare), free_port()
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port), DARKROOM_CONCURRENCY="1")
    wait_for(file_env, "SELECT 1 FROM photos WHERE processing_state = 'processed'", proc=worker)
    admin.replicaof("127.0.0.1", free_port())
    try:
        assert wait_down(port, "queue", worker).startswith("read_only")
        time.sleep(8)
    finally:
        admin.replicaof("NO", "ONE")
    stderr = finish(file_env, worker, ids)
    lines = log_lines(stderr)
    down = next(i for i, e in enumerate(lines) if e["event"] == "dependency down: pausing intake")
    back = next(i for i, e in enumerate(lines) if e["event"] == "dependency back: resuming")
    assert back - down <= 12, f"{back - down} log lines in an 8 s failover:\n{stderr}"
    assert admin.xlen(file_env.stream) == 0


def _terminate(name: str) -> str:
    return (f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()")  # fmt: skip


def test_postgres_turned_read_only_pauses_and_burns_no_attempt(file_env: Env) -> None:
    """An Aurora-style failover (sessions on a server that refuses writes): the worker
    pauses with database read_only, then finishes every photo on its first delivery."""
    import asyncio

    ids = file_env.ingest(BATCH)
    name, port = file_env.database_url.rsplit("/", 1)[1], free_port()
    asyncio.run(pg_admin(f"ALTER DATABASE {name} SET default_transaction_read_only = on"))
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port))
    try:
        assert wait_down(port, "database", worker).startswith("read_only")
        time.sleep(3)
        assert file_env.query("SELECT 1 FROM photos WHERE processing_state <> 'uploaded'") == []
    finally:
        asyncio.run(pg_admin(f"ALTER DATABASE {name} RESET default_transaction_read_only"))
    finish(file_env, worker, ids)


def test_s3_denying_everything_pauses_and_burns_no_attempt(s3_env: Env) -> None:
    """Revoked credentials (403 AccessDenied on every request): storage is down with
    access_denied, not the photos' fault; when access returns they are all published."""
    ids = s3_env.ingest(BATCH[:4])
    proxy, port = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"]), free_port()
    proxy.deny(lambda method, path: True)
    try:
        worker = s3_env.start("run", DARKROOM_S3_ENDPOINT_URL=proxy.url,
                              DARKROOM_METRICS_PORT=str(port))  # fmt: skip
        assert wait_down(port, "storage", worker).startswith("access_denied")
        time.sleep(2)
        proxy.deny(lambda method, path: False)
        finish(s3_env, worker, ids)
    finally:
        proxy.close()


def test_one_denied_original_fails_alone_as_object_forbidden(s3_env: Env) -> None:
    """One original the worker may not read while the bucket answers: that photo is
    dead-lettered as object_forbidden after its retries; the others are published."""
    ids = s3_env.ingest(BATCH[:3])
    key = s3_env.query("SELECT original_key FROM photos WHERE id = $1", ids[0])[0]["original_key"]
    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    proxy.deny(lambda method, path: method == "GET" and path.endswith(key))
    try:
        s3_env.cli("run", "--drain", DARKROOM_S3_ENDPOINT_URL=proxy.url,
                   DARKROOM_MAX_ATTEMPTS="2", DARKROOM_RETRY_BASE_MS="100",
                   DARKROOM_CLAIM_IDLE_MS="1000")  # fmt: skip
    finally:
        proxy.close()
    assert state(s3_env, ids[0])[0] == "processing_failed"
    assert {state(s3_env, i)[:2] for i in ids[1:]} == {("processed", "published")}
    [(_, letter)] = s3_env.redis.xrange(s3_env.dead)
    assert (letter["photo_id"], letter["error_code"]) == (str(ids[0]), "object_forbidden")


def test_a_least_privilege_policy_publishes_and_one_forbidden_original_fails_alone(
    s3_env: Env,
) -> None:
    """A key that may only read originals/*, write renditions/* and read back the probe
    (docs/configuration.md's policy), and one original under another key: the probe passes,
    that photo alone is dead-lettered as object_forbidden, the others are published."""
    ids = s3_env.ingest(BATCH[:3])
    key = s3_env.query("SELECT original_key FROM photos WHERE id = $1", ids[0])[0]["original_key"]
    bucket, prefix = s3_env.vars["DARKROOM_STORAGE_URL"].removeprefix("s3://").split("/")
    under = f"/{bucket}/{prefix}/"
    probe = f"{under}renditions/.darkroom-probe"

    def allowed(method: str, path: str) -> bool:
        if path.endswith(key):  # another KMS key, an object ACL
            return False
        reads = method == "GET" and (path.startswith(f"{under}originals/") or path == probe)
        return reads or (method == "PUT" and path.startswith(f"{under}renditions/"))

    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    proxy.deny(lambda method, path: not allowed(method, path.split("?")[0]))
    try:
        s3_env.cli("run", "--drain", DARKROOM_S3_ENDPOINT_URL=proxy.url, timeout=120,
                   DARKROOM_MAX_ATTEMPTS="2", DARKROOM_RETRY_BASE_MS="100",
                   DARKROOM_CLAIM_IDLE_MS="1000")  # fmt: skip
    finally:
        proxy.close()
    assert proxy.denied >= 2, "the forbidden original was asked for on each delivery"
    assert state(s3_env, ids[0])[0] == "processing_failed"
    assert {state(s3_env, i)[:2] for i in ids[1:]} == {("processed", "published")}
    [(_, letter)] = s3_env.redis.xrange(s3_env.dead)
    assert (letter["photo_id"], letter["error_code"]) == (str(ids[0]), "object_forbidden")
