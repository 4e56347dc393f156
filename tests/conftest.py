"""Shared fixtures: real PostgreSQL (per-test databases cloned from a migrated template),
real Redis (per-test stream names), and a real S3 HTTP endpoint (moto's server mode in a
subprocess on a free loopback port). Nothing is faked in-process."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import boto3
import pytest
import redis

from darkroom.store import db

PHOTOS = Path(__file__).parent / "photos"
PG_BASE = os.environ.get("DARKROOM_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("DARKROOM_TEST_REDIS", "redis://127.0.0.1:6379/0")
# One template per test session, so concurrent sessions (worktrees, CI) never drop each other's.
TEMPLATE = f"darkroom_test_template_{os.getpid()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _admin(sql: str) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(f"{PG_BASE}/postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(go())


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """A migrated database that each test clones (CREATE DATABASE … TEMPLATE)."""
    _admin(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
    asyncio.run(db.migrate(f"{PG_BASE}/{TEMPLATE}"))
    yield TEMPLATE
    _admin(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")


@pytest.fixture
def database_url(template_db: str) -> Iterator[str]:
    name = f"darkroom_t_{uuid.uuid4().hex[:12]}"
    _admin(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield f"{PG_BASE}/{name}"
    _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto in server mode: a real HTTP S3 endpoint in its own process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    name = f"darkroom-{uuid.uuid4().hex[:12]}"
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


def s3_client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )


@dataclass
class Env:
    """Settings for one test, passed to darkroom subprocesses as DARKROOM_* variables."""

    vars: dict[str, str]
    redis: redis.Redis
    tmp: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def stream(self) -> str:
        return self.vars["DARKROOM_STREAM"]

    @property
    def dead(self) -> str:
        return self.vars["DARKROOM_DEAD_LETTER_STREAM"]

    @property
    def database_url(self) -> str:
        return self.vars["DARKROOM_DATABASE_URL"]

    def environ(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
        return {**base, **AWS_ENV, **self.vars, **extra}

    def cli(self, *args: str, check: bool = True, timeout: float = 180, **extra: str) -> Any:
        result = subprocess.run(
            [sys.executable, "-m", "darkroom", *args],
            env=self.environ(**extra),
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"darkroom {args} exited {result.returncode}:\n{result.stderr}")
        return result

    def start(self, *args: str, **extra: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "darkroom", *args],
            env=self.environ(**extra),
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def kill_workers(self) -> None:
        """Kill what still runs and close every worker's pipes (read or not)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()

    def ingest(self, paths: list[Path]) -> list[uuid.UUID]:
        out = self.cli("ingest", *map(str, paths)).stdout.split()
        return [uuid.UUID(line) for line in out]

    def query(self, sql: str, *params: Any) -> list[dict[str, Any]]:
        async def go() -> list[dict[str, Any]]:
            conn = await asyncpg.connect(self.database_url)
            try:
                return [dict(r) for r in await conn.fetch(sql, *params)]
            finally:
                await conn.close()

        return asyncio.run(go())


def env_vars(
    database_url: str, storage: dict[str, str], redis_url: str = REDIS_URL
) -> dict[str, str]:
    """DARKROOM_* settings of one test: its own database and its own stream names."""
    tag = uuid.uuid4().hex[:10]
    return {
        "DARKROOM_REDIS_URL": redis_url,
        "DARKROOM_DATABASE_URL": database_url,
        "DARKROOM_STREAM": f"{{t{tag}}}:photos",
        "DARKROOM_DEAD_LETTER_STREAM": f"{{t{tag}}}:dead",
        "DARKROOM_EVENTS_STREAM": f"{{t{tag}}}:events",
        "DARKROOM_GROUP": "darkroom",
        "DARKROOM_CONCURRENCY": "2",
        "DARKROOM_LOG_FORMAT": "json",
        **storage,
    }


def _env(tmp_path: Path, database_url: str, storage: dict[str, str]) -> Iterator[Env]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    env = Env(vars=env_vars(database_url, storage), redis=client, tmp=tmp_path)
    yield env
    env.kill_workers()
    client.delete(env.stream, env.dead, f"{env.stream}:bulk", env.vars["DARKROOM_EVENTS_STREAM"])
    client.close()


@pytest.fixture
def s3_env(tmp_path: Path, database_url: str, s3_endpoint: str, s3_bucket: str) -> Iterator[Env]:
    """A darkroom configured for S3 (moto server) storage."""
    yield from _env(
        tmp_path,
        database_url,
        {
            "DARKROOM_STORAGE_URL": f"s3://{s3_bucket}/photos",
            "DARKROOM_S3_ENDPOINT_URL": s3_endpoint,
        },
    )


@pytest.fixture
def file_env(tmp_path: Path, database_url: str) -> Iterator[Env]:
    """A darkroom configured for the embedded default: a local folder."""
    yield from _env(tmp_path, database_url, {"DARKROOM_STORAGE_URL": "file:./var/storage"})
