"""Private Redis topologies on loopback for one test: single nodes, a primary + replica
watched by sentinels, and a 3-node cluster, each in plain TCP or TLS-only (a throwaway CA
made with openssl). Every server runs the `redis-server` on PATH without persistence, in
the test's tmp dir, and is killed by `close()` (the fixtures' finalizer)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from tests.chaos.rig import wait_until
from tests.conftest import free_port

SERVICE = "darkroom-primary"
NO_PERSISTENCE = ["--save", "", "--appendonly", "no"]


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


class Servers:
    """The redis-server processes of one test; with `certs`, every one is TLS-only
    (clients, replication, cluster bus; clients need not present a certificate)."""

    def __init__(self, tmp: Path, certs: dict[str, Path] | None = None) -> None:
        self.tmp, self.certs = tmp, certs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, *args: str, config: str | None = None, port: int | None = None
    ) -> int:
        """Start one server (its own dir and log) on `port` (a restart) or a free one;
        returns the port."""
        folder = self.tmp / name
        folder.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        cmd = ["redis-server", *([config] if config else []), *args, *self._listen(port)]
        cmd += ["--dir", str(folder), "--logfile", str(folder / "log"), *NO_PERSISTENCE]
        self.procs.append(subprocess.Popen(cmd, cwd=folder))
        with self.client(port) as node:
            wait_until(node.ping, f"redis-server {name} on port {port}")
        return port

    def _listen(self, port: int) -> list[str]:
        if not self.certs:
            return ["--port", str(port), "--bind", "127.0.0.1"]
        return [
            "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(self.certs["cert"]), "--tls-key-file", str(self.certs["key"]),
            "--tls-ca-cert-file", str(self.certs["ca"]), "--tls-auth-clients", "no",
            "--tls-replication", "yes", "--tls-cluster", "yes",
        ]  # fmt: skip

    def client(self, port: int) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": str(self.certs["ca"])} if self.certs else {}
        return redis.Redis(port=port, socket_timeout=2, decode_responses=True, **tls)  # type: ignore[arg-type]

    def cli(self, port: int, *command: str) -> str:
        """redis-cli against one server; its stdout."""
        args = ["redis-cli", *self.cli_tls(), "-h", "127.0.0.1", "-p", str(port), *command]
        return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip()

    def cli_tls(self) -> list[str]:
        return ["--tls", "--cacert", str(self.certs["ca"])] if self.certs else []

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
    wait_until(lambda: _in_sync(servers, replica), "replica in sync")
    ports = []
    for n in range(sentinels):
        config = servers.tmp / f"sentinel{n}.conf"
        config.write_text(
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        ports.append(servers.start(f"sentinel{n}", "--sentinel", config=str(config)))
    for port in ports:  # each sentinel has seen the replica, so it can fail over
        wait_until(lambda p=port: _sentinel_sees_replica(servers, p), f"sentinel {port}")  # type: ignore[misc]
    return primary, replica, ports


def _in_sync(servers: Servers, port: int) -> bool:
    with servers.client(port) as replica:
        return bool(replica.info("replication")["master_link_status"] == "up")


def _sentinel_sees_replica(servers: Servers, port: int) -> bool:
    with servers.client(port) as sentinel:
        replicas = sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE)
    return any(r["flags"] == "slave" and r["master-link-status"] == "ok" for r in replicas)


def primary_port(servers: Servers, sentinel_port: int) -> int:
    with servers.client(sentinel_port) as sentinel:
        _host, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
    return int(port)


def role(servers: Servers, port: int) -> str:
    with servers.client(port) as node:
        return str(node.role()[0])


def cluster_setup(servers: Servers, nodes: int = 3) -> list[int]:
    """`nodes` cluster-enabled servers joined by `redis-cli --cluster create` (no replicas).
    Returns their ports once every node reports cluster_state:ok."""
    ports = [
        servers.start(f"node{n}", "--cluster-enabled", "yes", "--cluster-port",
                      str(free_port()), "--cluster-config-file", "nodes.conf")
        for n in range(nodes)
    ]  # fmt: skip
    subprocess.run(
        ["redis-cli", *servers.cli_tls(), "--cluster", "create",
         *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    for port in ports:
        wait_until(lambda p=port: "cluster_state:ok" in servers.cli(p, "cluster", "info"), "ok")  # type: ignore[misc]
    return ports
