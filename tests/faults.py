"""Test servers for production faults: a spare redis-server (to demote, fill or lock
down), an S3 proxy that answers S3 errors on demand (403 AccessDenied, 503 SlowDown), and a
controlled clock."""

from __future__ import annotations

import http.client
import http.server
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import asyncpg
import redis

from tests.conftest import PG_BASE, free_port


def s3_error_xml(code: str, message: str) -> bytes:
    """S3's own error body."""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>darkroom-test</RequestId></Error>"
    ).encode()


DENIED_XML = s3_error_xml("AccessDenied", "Access Denied")
SLOW_DOWN_XML = s3_error_xml("SlowDown", "Please reduce your request rate.")


class FakeClock:
    """Time that moves only when a loop sleeps; `on_sleep(n)` runs at the n-th sleep."""

    def __init__(self, on_sleep: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.t, self.sleeps, self.on_sleep = 1000.0, list[float](), on_sleep

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float, until: anyio.Event) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        if self.on_sleep is not None:
            await self.on_sleep(len(self.sleeps))
        await anyio.lowlevel.checkpoint()


def spare_redis(tmp: Path) -> Iterator[int]:
    """A redis-server of our own on a free loopback port (fixture body)."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(tmp)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "spare redis-server did not start"
            time.sleep(0.05)
    yield port
    client.close()
    proc.terminate()
    proc.wait(10)


class DenyingS3Proxy:
    """Forwards HTTP to an S3 endpoint; `deny(predicate)` answers 403 AccessDenied (S3's
    own XML) to every request the predicate picks, as a revoked key or bucket policy does;
    `throttle(predicate)` answers 503 SlowDown, as S3 does past a prefix's request rate;
    `hold(predicate)` keeps the requests it picks unanswered (a stalled upload) until
    `release()`, which answers them 503 without forwarding them. `denied` counts the
    requests answered with an error."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.denies: Callable[[str, str], bool] = lambda method, path: False
        self.holds: Callable[[str, str], bool] = lambda method, path: False
        self.error: tuple[int, bytes] = (403, DENIED_XML)
        self.denied = self.held = 0
        self.released = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, error = proxy.error
                if proxy.denies(self.command, self.path):
                    proxy.denied += 1
                    self._answer(status, {"Content-Type": "application/xml"}, error)
                    return
                if proxy.holds(self.command, self.path):
                    proxy.held += 1
                    proxy.released.wait(120)
                    self._answer(503, {}, b"")
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:  # closed on every path: an upstream paused or reset must not leak it
                    conn.request(self.command, self.path, body, dict(self.headers))
                    response = conn.getresponse()
                    data = response.read()
                finally:
                    conn.close()
                headers = {k: v for k, v in response.getheaders()
                           if k.lower() not in ("transfer-encoding", "connection")}  # fmt: skip
                self._answer(response.status, headers, data)

            def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    if key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def deny(self, predicate: Callable[[str, str], bool]) -> None:
        self.error = (403, DENIED_XML)
        self.denies = predicate

    def throttle(self, predicate: Callable[[str, str], bool]) -> None:
        self.error = (503, SLOW_DOWN_XML)
        self.denies = predicate

    def hold(self, predicate: Callable[[str, str], bool]) -> None:
        self.holds = predicate

    def release(self) -> None:
        self.holds = lambda method, path: False
        self.released.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


async def pg_admin(sql: str) -> None:
    """Run one statement on the server's maintenance database (ALTER DATABASE, roles)."""
    conn = await asyncpg.connect(f"{PG_BASE}/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
