"""Chaos rig, all on loopback: a private redis-server (restartable, loses its data; can be
demoted to a replica), a moto S3 server, a PostgreSQL database (can be made read-only), TCP
proxies that can hang or cut connections (the S3 one can also deny every request with 403),
behind the S3 one an HTTP proxy that answers S3 errors to the requests it picks (503
SlowDown on a prefix), and restartable `darkroom run` workers whose JSON logs are kept in
the tmp dir."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import redis

from tests.conftest import AWS_ENV, PG_BASE, free_port, s3_client
from tests.faults import DenyingS3Proxy

BUCKET, PREFIX = "chaos", "photos/"
STREAM, DEAD, GROUP = "{darkroom}:photos", "{darkroom}:dead", "darkroom"
EVENTS = "{darkroom}:events"
BULK = f"{STREAM}:bulk"  # the bulk lane's stream (DARKROOM_BULK_STREAM's default)


def wait_until(probe: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if probe():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:g} s")
        time.sleep(0.1)


class Proxy:
    """TCP forwarder on its own event-loop thread: pause() holds every byte (a hang; the
    connections stay open), resume() lets them flow again, cut() drops every connection,
    refuse(True) drops every new one (the service is down) until refuse(False)."""

    refusing = False

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port: int = self._call(self._listen())

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _listen(self) -> int:
        self.flowing, self.writers = asyncio.Event(), set[asyncio.StreamWriter]()
        self.flowing.set()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self.writers |= pair
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self.writers -= pair
            for w in pair:
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def pause(self) -> None:
        self.loop.call_soon_threadsafe(self.flowing.clear)

    def resume(self) -> None:
        self.loop.call_soon_threadsafe(self.flowing.set)

    def cut(self) -> int:
        """Abort every open connection, both sides; returns how many were cut."""

        async def go() -> int:
            for w in list(self.writers):
                w.transport.abort()
            return len(self.writers) // 2

        return int(self._call(go()))

    def refuse(self, down: bool) -> None:
        self.refusing = down
        if down:
            self.cut()

    @property
    def url_host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        async def go() -> None:
            self.server.close()
            self.flowing.set()
            for w in list(self.writers):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server.wait_closed()

        self._call(go())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


ACCESS_DENIED = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    "<Message>Access Denied</Message><RequestId>{id}</RequestId><HostId>{id}</HostId></Error>"
)


class S3Proxy(Proxy):
    """The S3 forwarder, plus deny(True): every request answers 403 AccessDenied with S3's XML
    error body (revoked credentials, a bucket policy that denies the worker) until
    deny(False). Open connections are cut when denial starts, so none keeps reaching S3;
    each denial answers `Connection: close`, so the first request after it goes upstream."""

    denying = False
    denied = 0  # requests answered 403

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.denying:
            await super()._serve(reader, writer)
            return
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in head[1:] if line)}  # fmt: skip
            if "100-continue" not in headers.get("expect", "").lower():
                await _read_body(reader, headers)  # else the client waits: answer at once
            writer.write(_denial(head[0].split(" ")[0]))
            self.denied += 1
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def deny(self, on: bool) -> None:
        self.denying = on
        if on:
            self.cut()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            await reader.readexactly(size + 2)
        while (await reader.readline()).strip():  # trailers, up to the blank line
            pass
    elif length := int(headers.get("content-length", "0") or 0):
        await reader.readexactly(length)


def _denial(method: str) -> bytes:
    body = ACCESS_DENIED.format(id=uuid.uuid4().hex[:16].upper()).encode()
    head = ("HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: DENIED\r\n"
            "Connection: close\r\n\r\n")  # fmt: skip
    return head.encode() + (b"" if method == "HEAD" else body)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    consumer: str
    log: Path
    started: float
    reported: bool = False


class Rig:
    """Everything a chaos run needs; a context manager that tears it all down, even on error."""

    def __init__(self, tmp: Path, settings: dict[str, str], workers: int = 3) -> None:
        self.tmp, self.settings, self.n_workers = tmp, settings, workers
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.db = f"darkroom_chaos_{uuid.uuid4().hex[:10]}"
        self.redis_port, self.redis_starts = free_port(), 0
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.workers: dict[int, Worker] = {}
        self.spawned = 0
        self.crashes: list[dict[str, Any]] = []  # workers that exited on their own
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Rig:
        try:
            self._open()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _open(self) -> None:
        self.stack.callback(self.stop_redis)
        self.start_redis()
        moto_port = free_port()
        moto = self._spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                            str(moto_port)], self.tmp / "moto.log")  # fmt: skip
        self.stack.callback(lambda: (moto.kill(), moto.wait()))
        self.s3_url = f"http://127.0.0.1:{moto_port}"
        api = f"{self.s3_url}/moto-api/"
        wait_until(lambda: urllib.request.urlopen(api, timeout=1).close() is None, "moto server")
        self.s3 = s3_client(self.s3_url)
        self.stack.callback(self.s3.close)
        self.s3.create_bucket(Bucket=BUCKET)
        # workers → S3Proxy (TCP: pause, cut, deny all) → s3_faults (HTTP: per request) → moto
        self.s3_faults = DenyingS3Proxy(self.s3_url)
        self.stack.callback(self.s3_faults.close)
        faults_port = int(self.s3_faults.url.rsplit(":", 1)[1])
        self.s3_proxy = S3Proxy("127.0.0.1", faults_port)
        self.stack.callback(self.s3_proxy.close)
        pg = urlsplit(PG_BASE)
        self.pg_proxy = Proxy(pg.hostname or "127.0.0.1", pg.port or 5432)
        self.stack.callback(self.pg_proxy.close)
        self.stack.callback(self._drop_database)
        self.cli("migrate")
        self.stack.callback(self._kill_workers)

    def _spawn(self, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=out, **kwargs)

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, decode_responses=True, socket_timeout=10)

    def start_redis(self) -> None:
        self.redis_starts += 1
        argv = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.tmp)]  # fmt: skip
        self.redis_proc = self._spawn(argv, self.tmp / f"redis-{self.redis_starts}.log")
        wait_until(self._ping, "redis-server")

    def _ping(self) -> bool:
        with self.redis() as client:
            return bool(client.ping())

    def stop_redis(self) -> None:
        if self.redis_proc is not None:
            self.redis_proc.kill()
            self.redis_proc.wait()

    def restart_redis(self, down_s: float) -> None:
        """Kill it, stay down a while, start it again empty on the same port."""
        self.stop_redis()
        time.sleep(down_s)
        self.start_redis()

    def demote_redis(self) -> None:
        """Make our redis-server a replica of a dead primary, as a failover leaves the old
        primary: PING and reads answer, every write answers READONLY (replica-read-only is
        the default). The "primary" is a port we hold bound but never listen on, so the
        sync attempts are refused at once: the replica never starts a full sync, which would
        flush its dataset, and keeps its data (the failover test checks that its stream is
        unchanged). A client blocked in XREADGROUP gets an UNBLOCKED error at the demotion."""
        self.dead_primary = socket.socket()
        self.dead_primary.bind(("127.0.0.1", 0))
        self.stack.callback(self.dead_primary.close)
        with self.redis() as client:
            client.replicaof("127.0.0.1", self.dead_primary.getsockname()[1])

    def promote_redis(self) -> None:
        """`REPLICAOF NO ONE`: a primary again, with the data it had."""
        with self.redis() as client:
            client.replicaof("NO", "ONE")
        self.dead_primary.close()

    def pg_read_only(self, on: bool) -> int:
        """Make the database refuse writes (`default_transaction_read_only`, as a failover
        to a read replica does) or accept them again; the setting applies to new sessions,
        so every session of the database is terminated: the workers reconnect into it.
        Runs from the postgres database, in a session that is never read-only. Returns how
        many backends were terminated."""
        change = (
            "SET default_transaction_read_only = on"
            if on
            else "RESET default_transaction_read_only"
        )
        self.admin(
            "SET default_transaction_read_only = off", f'ALTER DATABASE "{self.db}" {change}'
        )
        return self.pg_terminate()

    def admin(self, *sqls: str) -> None:
        """Statements in one session on the postgres database."""

        async def go() -> None:
            conn = await asyncpg.connect(f"{PG_BASE}/postgres", timeout=10)
            try:
                for sql in sqls:
                    await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(go())

    def db_url(self, *, direct: bool) -> str:
        if direct:
            return f"{PG_BASE}/{self.db}"
        pg = urlsplit(PG_BASE)
        netloc = pg.netloc.replace(f"{pg.hostname}:{pg.port}", f"127.0.0.1:{self.pg_proxy.port}")
        return f"{pg._replace(netloc=netloc).geturl()}/{self.db}"

    def environ(self, *, direct: bool) -> dict[str, str]:
        """Workers go through the proxies; the producer and the checks go direct."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
        return base | AWS_ENV | {
            "DARKROOM_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "DARKROOM_DATABASE_URL": self.db_url(direct=direct),
            "DARKROOM_STORAGE_URL": f"s3://{BUCKET}/{PREFIX.rstrip('/')}",
            "DARKROOM_S3_ENDPOINT_URL": self.s3_url if direct
            else f"http://127.0.0.1:{self.s3_proxy.port}",
            "DARKROOM_STREAM": STREAM,
            "DARKROOM_DEAD_LETTER_STREAM": DEAD,
            "DARKROOM_EVENTS_STREAM": EVENTS,
            "DARKROOM_GROUP": GROUP,
            "DARKROOM_LOG_FORMAT": "json",
        } | self.settings  # fmt: skip

    def cli(self, *args: str, direct: bool = True, timeout: float = 300) -> Any:
        result = subprocess.run([sys.executable, "-m", "darkroom", *args], cwd=self.tmp,
                                env=self.environ(direct=direct), capture_output=True,
                                text=True, timeout=timeout)  # fmt: skip
        if result.returncode != 0:
            raise AssertionError(f"darkroom {args[0]} exited {result.returncode}:\n{result.stderr}")
        return result

    def ingest(self, paths: list[Path], *options: str) -> list[str]:
        return list(self.cli("ingest", *options, *map(str, paths)).stdout.split())

    def query(self, sql: str, *params: Any, db: str | None = None) -> list[dict[str, Any]]:
        async def go() -> list[dict[str, Any]]:
            conn = await asyncpg.connect(f"{PG_BASE}/{db or self.db}", timeout=10)
            try:
                return [dict(r) for r in await conn.fetch(sql, *params)]
            finally:
                await conn.close()

        return asyncio.run(go())

    def pg_terminate(self) -> int:
        """Terminate every backend of the database, from a connection to the postgres db."""
        sql = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1"
        return len(self.query(f"{sql} AND pid <> pg_backend_pid()", self.db, db="postgres"))

    def _drop_database(self) -> None:
        self.query(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)', db="postgres")

    def start_worker(self, slot: int) -> None:
        self.spawned += 1
        consumer = f"chaos-w{slot}-{self.spawned:03d}"
        log = self.logs / f"{consumer}.log"
        env = self.environ(direct=False) | {"DARKROOM_CONSUMER": consumer}
        proc = self._spawn([sys.executable, "-m", "darkroom", "run"], log, cwd=self.tmp, env=env,
                           start_new_session=True)  # fmt: skip
        self.workers[slot] = Worker(proc, consumer, log, time.monotonic())

    def signal_worker(self, slot: int, sig: signal.Signals) -> None:
        """Signal the worker's process group: the worker, its forkserver and its renders."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.workers[slot].proc.pid, sig)

    def kill_worker(self, slot: int) -> None:
        """SIGKILL a worker (a lost container) and restart it right away."""
        self.signal_worker(slot, signal.SIGKILL)
        self.workers[slot].proc.wait()
        self.workers[slot].reported = True
        self.start_worker(slot)

    def holding(self, attempts: int) -> set[int]:
        """Workers holding a job on its attempt `attempts` (of this run) or later: PostgreSQL
        counts the attempts (a SIGKILL ends one)."""
        sql = ("SELECT DISTINCT consumer FROM photo_jobs"
               " WHERE state = 'active' AND attempt - run_offset >= $1")  # fmt: skip
        with contextlib.suppress(Exception):
            hot = {row["consumer"] for row in self.query(sql, attempts)}
            return {slot for slot, w in self.workers.items() if w.consumer in hot}
        return set()

    def tend(self) -> None:
        """Restart workers that exited by themselves, as a container restart policy would
        (the workers' feeder feeds the bulk lane)."""
        for slot, w in list(self.workers.items()):
            if (rc := w.proc.poll()) is None:
                continue
            if not w.reported:
                w.reported = True
                tail = w.log.read_text(errors="replace").strip().splitlines()[-2:]
                self.crashes.append({"slot": slot, "rc": rc, "log": w.log.name, "tail": tail})
                if rc == 2:
                    raise RuntimeError(f"a worker refused its settings: {tail}")
            if time.monotonic() - w.started >= 1.0:
                self.signal_worker(slot, signal.SIGKILL)  # leftovers of its group, if any
                self.start_worker(slot)

    def stop_workers(self, grace_s: float) -> dict[int, int | str]:
        """SIGTERM each worker's main process (as `docker stop` does); their exit codes."""
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        codes: dict[int, int | str] = {}
        for slot, w in self.workers.items():
            try:
                codes[slot] = w.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal_worker(slot, signal.SIGKILL)
                w.proc.wait()
                codes[slot] = f"still running {grace_s:g} s after SIGTERM: killed"
        return codes

    def _kill_workers(self) -> None:
        for slot, w in self.workers.items():
            if w.proc.poll() is None:
                self.signal_worker(slot, signal.SIGKILL)
            w.proc.wait()

    def log_records(self) -> list[dict[str, Any]]:
        """Every JSON log line of the workers and the drain run, with `ts` in epoch seconds."""
        records = []
        for path in sorted(self.logs.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record = json.loads(line)
                    record["ts"] = datetime.fromisoformat(record["timestamp"]).timestamp()
                    records.append(record)
        return records

    def worker_cpu_s(self) -> float:
        """CPU seconds used so far by the live workers' main processes (renders excluded)."""
        ticks = 0
        for w in self.workers.values():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{w.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(stat[11]) + int(stat[12])  # utime, stime (fields 14, 15)
        return ticks / os.sysconf("SC_CLK_TCK")

    def extra_deliveries(self) -> int:
        """Deliveries beyond each photo's first: sum of `photo_jobs.attempt - 1`."""
        sql = "SELECT coalesce(sum(attempt - 1), 0) AS n FROM photo_jobs WHERE attempt > 0"
        return int(self.query(sql)[0]["n"])

    def unfinished(self) -> int:
        """Photos neither processed+published, processing_failed nor erased."""
        return int(self.query("SELECT count(*) AS n FROM photos WHERE NOT ((processing_state ="
                              " 'processed' AND visibility = 'published')"
                              " OR processing_state IN ('processing_failed', 'erased'))"
                              )[0]["n"])  # fmt: skip

    def objects_of(self, photo_id: str, original_key: str | None) -> list[str]:
        """The objects left in S3 of an erased photo: under its renditions folder, and its
        original (erased with --original)."""
        listed = self.s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}renditions/{photo_id}/")
        left = [obj["Key"] for obj in listed.get("Contents", [])]
        with contextlib.suppress(Exception):  # absent: head_object raises
            if original_key and self.s3.head_object(Bucket=BUCKET, Key=PREFIX + original_key):
                left.append(PREFIX + original_key)
        return left

    def gc_ahead(self) -> dict[str, int]:
        """`darkroom gc --older-than 300` as run an hour from now (its default grace): what
        it would collect once every upload of the run is past its grace. The gc code runs
        in a subprocess, with the rig's settings (direct), on a clock set ahead."""
        script = (
            "import asyncio, json, sys, time\n"
            "from darkroom.config.env import from_env\n"
            "from darkroom.operate import gc\n"
            "from darkroom.services import services, storage_for\n"
            "async def go():\n"
            "    settings = from_env()\n"
            "    async with services(settings, 1) as (pool, _), storage_for(settings) as s:\n"
            "        return await gc.collect(pool, s, older_than_s=gc.MIN_GRACE_S,\n"
            "            now_s=time.time() + gc.GRACE_S, dry_run=False, say=lambda _: None)\n"
            "print(json.dumps(dict(asyncio.run(go()))))\n"
        )
        env = self.environ(direct=True)
        result = subprocess.run([sys.executable, "-c", script], cwd=self.tmp, env=env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        if result.returncode != 0:
            raise AssertionError(f"gc exited {result.returncode}:\n{result.stderr}")
        return dict(json.loads(result.stdout.strip().splitlines()[-1]))

    def backlog(self) -> tuple[int, int]:
        """(length, entries pending in the group) of both lanes' work streams."""
        length = pending = 0
        with self.redis() as client:
            for stream in (STREAM, BULK):
                length += int(client.xlen(stream))
                with contextlib.suppress(redis.ResponseError):  # no group
                    pending += int(client.xpending(stream, GROUP)["pending"])
        return length, pending
