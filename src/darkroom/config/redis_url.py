"""DARKROOM_REDIS_URL: one node, a Sentinel service or a Cluster, parsed into a RedisTarget.

The URL's scheme names the topology, its hosts the nodes and its query string the redis-py
connection options this module accepts; queue.streams opens the client from the target.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import msgspec

from darkroom.config import convert

Topology = Literal["single", "sentinel", "cluster"]
SCHEMES: dict[str, tuple[Topology, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}


def _flag(raw: str) -> bool:
    if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError("must be true or false")
    return raw.lower() in ("1", "true", "yes")


# The floor of the URL's durations (seconds) and counts; socket_timeout must also exceed
# DARKROOM_READ_BLOCK_MS by 1 s (checked by darkroom.config.env).
REDIS_MINIMUMS: dict[str, float] = {
    "socket_timeout": 1.0,
    "socket_connect_timeout": 0.1,
    "health_check_interval": 1.0,
    "max_connections": 1,
}
# Connection options accepted in the URL's query string (redis-py keyword arguments).
REDIS_OPTIONS: dict[str, Callable[[str], Any]] = {
    "socket_timeout": convert.at_least(float, REDIS_MINIMUMS["socket_timeout"]),
    "socket_connect_timeout": convert.at_least(float, REDIS_MINIMUMS["socket_connect_timeout"]),
    "health_check_interval": convert.at_least(float, REDIS_MINIMUMS["health_check_interval"]),
    "max_connections": convert.at_least(int, REDIS_MINIMUMS["max_connections"]),
    "client_name": convert.nonempty,
    "ssl_ca_certs": convert.nonempty,
    "ssl_certfile": convert.nonempty,
    "ssl_keyfile": convert.nonempty,
    "ssl_cert_reqs": convert.choice("required", "optional", "none"),
    "ssl_check_hostname": _flag,
}
SENTINEL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "sentinel_username": convert.nonempty,
    "sentinel_password": convert.nonempty,
}


class RedisTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Where the streams live. `nodes` are the server (single), the sentinels, or the
    cluster's seed nodes; `options` are redis-py connection keyword arguments."""

    url: str
    topology: Topology
    tls: bool = False
    nodes: tuple[tuple[str, int], ...] = ()
    unix_path: str | None = None
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)


def parse_redis_url(raw: str) -> RedisTarget:
    """`redis[s]://[user:pass@]host[:port][/db]`, `unix:///path.sock[?db=N]`,
    `redis[s]+sentinel://[user:pass@]host:port[,host:port...]/service[/db]` and
    `redis[s]+cluster://[user:pass@]host:port[,host:port...]`, each with an optional
    `?option=value&...` from REDIS_OPTIONS. Raises ValueError with the reason."""
    parts = urlsplit(raw)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(f'{s}://' for s in SCHEMES)}")
    topology, tls = SCHEMES[parts.scheme]
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    target = RedisTarget(
        url=raw,
        topology=topology,
        tls=tls,
        username=unquote(username) or None,
        password=unquote(password) or None,
        options=_redis_options(parts.query, topology, tls),
    )
    if parts.scheme == "unix":
        return _unix_target(target, parts.path)
    return _located(target, _redis_nodes(hosts, topology), parts.path)


def _redis_options(query: str, topology: Topology, tls: bool) -> dict[str, Any]:
    allowed = {**REDIS_OPTIONS, **(SENTINEL_OPTIONS if topology == "sentinel" else {})}
    if topology != "cluster":
        allowed["db"] = _db
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in allowed:
            raise ValueError(f"unknown option {name!r} (known: {', '.join(sorted(allowed))})")
        if name.startswith("ssl_") and not tls:
            raise ValueError(f"option {name} needs TLS (rediss://, rediss+sentinel://, ...)")
        try:
            options[name] = allowed[name](value)
        except ValueError as exc:
            raise ValueError(f"option {name}: {exc}") from None
    return options


def _db(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 10_000:
        raise ValueError("database number must be 0 or more")
    return value


def _redis_nodes(hosts: str, topology: Topology) -> tuple[tuple[str, int], ...]:
    """`host[:port]`, or for sentinel and cluster a comma-separated list (IPv6 in [])."""
    default_port = 26379 if topology == "sentinel" else 6379
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        parsed = urlsplit(f"//{item}")
        if not parsed.hostname:
            raise ValueError(f"{item!r} is not host[:port]")
        nodes.append((parsed.hostname, parsed.port or default_port))
    if topology == "single" and len(nodes) > 1:
        raise ValueError("several hosts need redis+sentinel:// or redis+cluster://")
    return tuple(nodes)


def _located(target: RedisTarget, nodes: tuple[tuple[str, int], ...], path: str) -> RedisTarget:
    """Apply the URL path: `/db` (single), `/service[/db]` (sentinel), nothing (cluster)."""
    segments = [unquote(s) for s in path.split("/") if s]
    service = segments.pop(0) if target.topology == "sentinel" and segments else None
    if target.topology == "sentinel" and not service:
        raise ValueError("redis+sentinel:// needs the service name: host:port,.../SERVICE[/db]")
    if len(segments) > 1 or (segments and target.topology == "cluster"):
        raise ValueError(f"unexpected path {path!r} (a cluster has only database 0)")
    db = _db(segments[0]) if segments else 0
    db = target.options.pop("db", db)
    return msgspec.structs.replace(target, nodes=nodes, service=service, db=db)


def _unix_target(target: RedisTarget, path: str) -> RedisTarget:
    if not path:
        raise ValueError("unix:// needs a socket path: unix:///run/redis.sock")
    db = target.options.pop("db", 0)
    return msgspec.structs.replace(target, unix_path=unquote(path), db=db)
