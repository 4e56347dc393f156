"""Private Redis topologies on loopback for one test: plain nodes, a TLS node with a
throwaway CA, a primary + replica watched by sentinels, and a 3-node cluster. Every server
runs the `redis-server` on PATH without persistence, in the test's tmp dir, and is killed
by `close()` (the fixtures' finalizer)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tests.conftest import free_port

SERVICE = "darkroom-primary"
NO_PERSISTENCE = ["--save", "", "--appendonly", "no"]


def wait_until(probe: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if probe():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g} s")
        time.sleep(0.05)


class Servers:
    """The redis-server processes of one test."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, list[subprocess.Popen[bytes]]()

    def start(self, name: str, *args: str, port: int | None = None) -> int:
        """Start one server (its own dir and log); returns its plain TCP port (0 if none)."""
        folder = self.tmp / name
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port() if port is None else port
        cmd = ["redis-server", *args, "--port", str(port), "--bind", "127.0.0.1"]
        cmd += ["--dir", str(folder), "--logfile", str(folder / "log"), *NO_PERSISTENCE]
        self.procs.append(subprocess.Popen(cmd, cwd=folder))
        if port:
            with client(port) as node:
                wait_until(node.ping, f"redis-server {name} on port {port}")
        return port

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def sentinel_setup(servers: Servers, sentinels: int = 2) -> tuple[int, int, list[int]]:
    """A primary, one replica in sync, and sentinels that watch them (quorum 1, failing
    over in seconds). Returns (primary port, replica port, sentinel ports)."""
    primary = servers.start("primary")
    replica = servers.start("replica", "--replicaof", "127.0.0.1", str(primary))
    wait_until(lambda: _in_sync(replica), "replica in sync")
    ports = []
    for n in range(sentinels):
        port = free_port()
        folder = servers.tmp / f"sentinel{n}"
        folder.mkdir()
        (folder / "sentinel.conf").write_text(
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        servers.start(f"sentinel{n}", str(folder / "sentinel.conf"), "--sentinel", port=port)
        ports.append(port)
    for port in ports:  # each sentinel has found the replica, so it can fail over
        wait_until(lambda p=port: _sentinel_sees_replica(p), f"sentinel {port} ready")  # type: ignore[misc]
    return primary, replica, ports


def client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=2, decode_responses=True)


def _in_sync(port: int) -> bool:
    with client(port) as replica:
        return bool(replica.info("replication")["master_link_status"] == "up")


def _sentinel_sees_replica(port: int) -> bool:
    with client(port) as sentinel:
        replicas = sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE)
    return any(r["flags"] == "slave" and r["master-link-status"] == "ok" for r in replicas)


def primary_port(sentinel_port: int) -> int:
    with client(sentinel_port) as sentinel:
        _host, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
    return int(port)


def role(port: int) -> str:
    with client(port) as node:
        return str(node.role()[0])


def cluster_setup(servers: Servers, nodes: int = 3) -> list[int]:
    """`nodes` cluster-enabled servers joined by `redis-cli --cluster create` (no replicas).
    Returns their ports once every node reports cluster_state:ok."""
    ports = []
    for n in range(nodes):
        bus = str(free_port())
        args = ["--cluster-enabled", "yes", "--cluster-port", bus]
        ports.append(servers.start(f"node{n}", *args, "--cluster-config-file", "nodes.conf"))
    addresses = [f"127.0.0.1:{p}" for p in ports]
    subprocess.run(
        ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
         "--cluster-yes"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    for port in ports:
        with client(port) as node:
            wait_until(lambda n=node: n.cluster("info")["cluster_state"] == "ok", "cluster ok")  # type: ignore[misc]
    return ports


def make_certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {k: folder / f"{k}.pem" for k in ("ca", "ca_key", "cert", "key")}
    csr, ext = folder / "server.csr", folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
         "-keyout", files["ca_key"], "-out", files["ca"]],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", files["key"], "-out", csr],
        ["x509", "-req", "-in", csr, "-CA", files["ca"], "-CAkey", files["ca_key"],
         "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", files["cert"]],
    ]  # fmt: skip
    for args in openssl:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    return files


def tls_server(servers: Servers, certs: dict[str, Path]) -> int:
    """A TLS-only node (no plain port); clients need not present a certificate."""
    port = free_port()
    servers.start(
        "tls", "--tls-port", str(port), "--tls-cert-file", str(certs["cert"]),
        "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]),
        "--tls-auth-clients", "no", port=0,
    )  # fmt: skip
    with redis.Redis(port=port, ssl=True, ssl_ca_certs=str(certs["ca"])) as node:
        wait_until(node.ping, "TLS redis-server")
    return port
