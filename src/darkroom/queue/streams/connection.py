"""The Redis client and what its failures mean: `connect` opens one node, the primary of a
Sentinel service or a Cluster from DARKROOM_REDIS_URL, and ERRORS (applied by `translated`)
turns every driver error into QueueUnavailableError with its reason.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as redis
from redis import exceptions as rx
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from darkroom import errors
from darkroom.config.redis_url import RedisTarget, parse_redis_url
from darkroom.errors import PERMANENT, TRANSIENT, QueueUnavailableError, Rule


def _prefix(*words: str) -> Any:
    return lambda exc: str(exc).startswith(words)


Q, T, P = QueueUnavailableError, TRANSIENT, PERMANENT
# What each Redis failure says about Redis, first match wins. Every row is a queue error
# (the gate probes: if the probe fails too, it is an outage and the entry waits); a
# transient one never counts an attempt, a permanent one does if the probe passes.
ERRORS: tuple[Rule, ...] = (
    Rule(rx.ReadOnlyError, Q, "read_only", T),  # a demoted primary (failover)
    Rule(rx.BusyLoadingError, Q, "loading", T),  # a restarted node reading its dataset
    Rule(rx.MasterDownError, Q, "master_down", T),  # a replica that lost its primary
    Rule((rx.ClusterDownError, rx.TryAgainError, rx.SlotNotCoveredError), Q, "cluster_down", T),
    # not a rx.RedisError: no seed node of the cluster answered
    Rule(rx.RedisClusterException, Q, "cluster_unreachable", T),
    Rule(rx.OutOfMemoryError, Q, "out_of_memory", T),  # maxmemory reached
    Rule((rx.AuthenticationError, rx.AuthorizationError), Q, "auth", P),
    Rule(rx.NoPermissionError, Q, "no_permission", P),  # ACL revoked
    Rule(rx.ResponseError, Q, "misconf", T, _prefix("MISCONF")),  # RDB/AOF write failing
    Rule(rx.ResponseError, Q, "wrong_type", P, _prefix("WRONGTYPE")),  # a key of another type
    Rule(rx.ResponseError, Q, "no_group", P, _prefix("NOGROUP")),
    Rule((rx.TimeoutError, TimeoutError), Q, "timeout", T),
    Rule((rx.ConnectionError, OSError), Q, "connection", T),
    Rule(rx.RedisError, Q, "error", P),
)
translated = errors.translated(ERRORS)


# redis-py connection defaults; the URL's query options override them. BLOCK reads stay
# at most 5 s (settings), well under the socket timeout.
CONNECTION_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 15,
    "socket_connect_timeout": 5,
    "health_check_interval": 30,
}


# One immediate reconnect (a pooled connection the server closed), no more: whether a Redis
# error is waited out, retried in place or counted is darkroom's to decide, with its own
# backoff (see ERRORS). redis-py 8's default (10 retries, backoff up to 10 s) hid an outage
# for about a minute inside one command, and held a stop request as long. A cluster client
# keeps its own retries: they follow the slot map.
def _driver_retry() -> Retry:
    return Retry(NoBackoff(), 1)


# Asking a sentinel where the primary is must fail fast, so the next sentinel is asked.
SENTINEL_DEFAULTS: dict[str, Any] = {"socket_timeout": 2, "socket_connect_timeout": 2}

Client = redis.Redis | RedisCluster


def connect(url: str) -> Client:
    """A client for DARKROOM_REDIS_URL: one node, the primary of a Sentinel service (found
    again after a failover: a READONLY reply makes it ask the sentinels), or a Cluster."""
    target = parse_redis_url(url)
    options = {**CONNECTION_DEFAULTS, **_credentials(target), **target.options}
    options["decode_responses"] = True
    if target.topology == "sentinel":
        return _sentinel_primary(target, {"retry": _driver_retry(), **options})
    if target.topology == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(startup_nodes=nodes, ssl=target.tls, **options)
    options["retry"] = _driver_retry()
    if target.unix_path:
        return redis.Redis(unix_socket_path=target.unix_path, db=target.db, **options)
    host, port = target.nodes[0]
    return redis.Redis(host=host, port=port, db=target.db, ssl=target.tls, **options)


def _credentials(target: RedisTarget) -> dict[str, Any]:
    return {"username": target.username, "password": target.password}


class SentinelPrimary(redis.Redis):
    """The primary of a Sentinel service; closing it closes the sentinel connections too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        sentinels = self.connection_pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
        await super().aclose(close_connection_pool)
        for sentinel in sentinels:
            await sentinel.aclose()


def _sentinel_primary(target: RedisTarget, options: dict[str, Any]) -> redis.Redis:
    sentinel_options = {
        **SENTINEL_DEFAULTS,
        "username": options.pop("sentinel_username", None),
        "password": options.pop("sentinel_password", None),
        "decode_responses": True,
    }
    if target.tls:
        ssl = {k: v for k, v in options.items() if k.startswith("ssl_")}
        sentinel_options.update(ssl=True, **ssl)
    sentinel = Sentinel(
        list(target.nodes), sentinel_kwargs=sentinel_options, db=target.db, ssl=target.tls,
        **options,
    )  # fmt: skip
    primary: redis.Redis = sentinel.master_for(str(target.service), redis_class=SentinelPrimary)
    return primary
