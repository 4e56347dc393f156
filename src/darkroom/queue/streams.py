"""Redis Streams I/O: group, read, reclaim, heartbeat, ack, backoff, dead-letter, status.

Invariants: an entry is acked (and deleted, so the stream holds only the backlog) only
after Postgres committed its outcome; nothing pending is ever trimmed; the dead-letter
XADD and the source XACK+XDEL happen in one Lua script (keys of one hash slot); entries
are read as raw bytes (RAW_READS), so nothing a producer sends can fail a read. Driver
errors become QueueUnavailableError here.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis.asyncio as redis
from redis import exceptions as rx
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.client import NEVER_DECODE

from darkroom import errors
from darkroom.config.redis_url import RedisTarget, parse_redis_url
from darkroom.errors import PERMANENT, TRANSIENT, QueueUnavailableError, Rule
from darkroom.queue.messages import Entry, received


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

# Heartbeat and backoff touch only entries this consumer still owns: a stale worker must
# not take back an entry another consumer has reclaimed. XPENDING + XCLAIM in one script
# (atomic, and one slot: Cluster-safe). KEYS[1] stream; ARGV group, consumer, idle ms
# ('' = now), ids... Returns the ids it refreshed.
_REFRESH_OWNED = """
local owned = {}
for i = 4, #ARGV do
  local row = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if type(row) == 'table' and row.err then
    if string.find(row.err, 'NOGROUP', 1, true) then return {} end
    return row
  end
  if row[1] and row[1][2] == ARGV[2] then owned[#owned + 1] = ARGV[i] end
end
if #owned == 0 then return {} end
local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for _, id in ipairs(owned) do args[#args + 1] = id end
if ARGV[3] ~= '' then args[#args + 1] = 'IDLE'; args[#args + 1] = ARGV[3] end
args[#args + 1] = 'JUSTID'
return redis.call(unpack(args))
"""


# Hand an entry this consumer holds back to the live owner of its job (it reclaimed the
# entry after a Redis outage ate the owner's heartbeat): XCLAIM to that consumer, JUSTID, so
# no delivery is counted and the owner's heartbeat keeps it again. One script: the entry
# moves only if this consumer still holds it. KEYS[1] stream; ARGV group, this consumer,
# the owner, id. Returns 1 if it moved.
_HAND_BACK = """
local row = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)
if type(row) == 'table' and row.err then
  if string.find(row.err, 'NOGROUP', 1, true) then return 0 end
  return row
end
if not row[1] or row[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[4], 'JUSTID')
return 1
"""


def _no_group(exc: rx.ResponseError) -> bool:
    """Redis lost the group (restarted empty): the entry is gone, Postgres will recover it."""
    return str(exc).startswith("NOGROUP")


@contextlib.contextmanager
def _group_may_be_gone() -> Iterator[None]:
    """Acting on an entry of a group Redis lost is a no-op, not an error."""
    try:
        yield
    except rx.ResponseError as exc:
        if not _no_group(exc):
            raise


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


# Entries move between the two streams in Lua scripts over keys of one hash slot, atomic on
# a single node, behind Sentinel and on a Cluster alike (the asyncio cluster client of the
# older redis-py versions pyproject allows refuses MULTI).
# XACK runs under pcall so that, as in a MULTI, the rest runs when the group is gone; its
# error is handed back for `_no_group` to judge.
ACK_LUA = """
local acked = redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if type(acked) == 'table' and acked.err then return redis.error_reply(acked.err) end
return acked
"""
# KEYS: dead stream, work stream, the entry's mark; ARGV: maxlen, group, entry id, consumer,
# mark TTL s, field, value, ...
# One letter per entry, however often the call is sent: a client that lost the reply and
# sends it again (redis-py retries once on a dropped connection) finds the mark and gets the
# first letter's id; the entry, acked and deleted by then, cannot tell it (it is pending with
# nobody, which a lost group looks like too). An entry pending with another consumer is not
# ours to dead-letter: it reclaimed the entry while this one was slow, and will dead-letter
# it itself. An entry pending with nobody (the group lost in a restart) gets its letter.
DEAD_LETTER_LUA = """
local done = redis.call('GET', KEYS[3])
if done then return {done, ''} end
local row = redis.pcall('XPENDING', KEYS[2], ARGV[2], ARGV[3], ARGV[3], 1)
if type(row) == 'table' and not row.err and row[1] and row[1][2] ~= ARGV[4] then
  return {'', 'not_owner'}
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 6))
redis.call('SET', KEYS[3], id, 'EX', ARGV[5])
local acked = redis.pcall('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
if type(acked) == 'table' and acked.err then return {id, acked.err} end
return {id, ''}
"""
# How long an entry's mark outlives its letter: far past any resend of the same call (one
# immediate retry here; a cluster client's few, within seconds), short enough that marks
# cost little memory (about 100 bytes each) after a burst of failures.
LETTERED_TTL_S = 3600


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


# The ids among ARGV that are not in the stream KEYS[1] (one key: valid on a cluster).
MISSING_LUA = """
local gone = {}
for _, id in ipairs(ARGV) do
    if #redis.call('XRANGE', KEYS[1], id, id, 'COUNT', 1) == 0 then gone[#gone + 1] = id end
end
return gone
"""


# Entries are untrusted bytes: these reads answer raw, undecoded RESP (NEVER_DECODE, and
# no redis-py callback, whose dict would hide a repeated field), parsed by `_entries`.
# Decoding a reply is then never the part that fails, whatever a producer sent.
RAW_READS = ("XREADGROUP", "XAUTOCLAIM", "XCLAIM", "XRANGE")


def _raw(response: Any, **options: Any) -> Any:
    return response


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _entries(raw: Iterable[Any] | None, lane: str = "interactive") -> list[Entry]:
    """Entries from a raw `[[id, [name, value, ...]], ...]`. An entry deleted while pending
    comes back without fields (`[id, nil]`) and is left out: its photo is the sweep's."""
    return [received(_text(i), fields, lane) for i, fields in raw or [] if fields is not None]


def _by_stream(reply: Any) -> list[tuple[str, Any]]:
    """XREADGROUP's reply as (stream, raw entries) pairs, RESP2 list or RESP3 map alike."""
    if isinstance(reply, dict):  # RESP3 (redis-py 8's default): a map {stream: entries}
        reply = list(reply.items())
    return [(_text(stream), raw) for stream, raw in reply or []]


class Streams:
    """One lane's work stream + consumer group + dead-letter stream, seen by one consumer;
    `for_lane` gives the view of another lane's stream (same client, group and consumer,
    its own XAUTOCLAIM cursor)."""

    def __init__(
        self,
        client: Client,
        stream: str,
        group: str,
        consumer: str,
        dead_stream: str,
        dead_maxlen: int = 100_000,
        lane_streams: dict[str, str] | None = None,
    ) -> None:
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.dead_stream, self.dead_maxlen = dead_stream, dead_maxlen
        self.lane = "interactive"
        self.lane_streams = lane_streams or {self.lane: stream, "bulk": f"{stream}:bulk"}
        self._views: dict[str, Streams] = {self.lane: self}  # shared by every view
        self._cursor = "0-0"
        self._scripts: dict[str, Any] = {}
        for command in RAW_READS:  # on this client, these commands answer raw RESP
            client.set_response_callback(command, _raw)

    def for_lane(self, lane: str) -> Streams:
        """The view of `lane`'s stream (KeyError for a lane without one)."""
        if lane not in self._views:
            view = copy.copy(self)
            view.lane, view.stream, view._cursor = lane, self.lane_streams[lane], "0-0"
            self._views[lane] = view
        return self._views[lane]

    def lanes(self) -> list[Streams]:
        return [self.for_lane(lane) for lane in self.lane_streams]

    async def _read(self, *args: str | int) -> Any:
        """One of RAW_READS, its reply as undecoded bytes."""
        return await self.client.execute_command(*args, **{NEVER_DECODE: True})

    @translated
    async def ensure_group(self) -> None:
        """The group on every lane's stream: one name, read on all of them."""
        for stream in self.lane_streams.values():
            try:
                await self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except rx.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    @translated
    async def enqueue(self, fields: dict[str, str]) -> str:
        return str(await self.client.xadd(self.stream, fields))  # type: ignore[arg-type]

    @translated
    async def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` new entries of this lane; `block_ms` None answers at once."""
        block: list[str | int] = [] if block_ms is None else ["BLOCK", block_ms]
        reply = await self._read("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT",
                                 count, *block, "STREAMS", self.stream, ">")  # fmt: skip
        return [e for _, raw in _by_stream(reply) for e in _entries(raw, self.lane)]

    @translated
    async def read_lanes(self, lanes: Sequence[str], block_ms: int) -> list[Entry]:
        """At most one new entry of each of `lanes`, blocking until one arrives: one
        XREADGROUP over their streams (one hash slot), so either lane wakes it."""
        keys = [self.lane_streams[lane] for lane in lanes]
        ids = [">"] * len(keys)
        reply = await self._read("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT",
                                 1, "BLOCK", block_ms, "STREAMS", *keys, *ids)  # fmt: skip
        lane_of = {stream: lane for lane, stream in self.lane_streams.items()}
        return [e for key, raw in _by_stream(reply) for e in _entries(raw, lane_of[key])]

    @translated
    async def read_own_pending(self, count: int) -> list[Entry]:
        """Take back what this consumer name held before a restart, counting a delivery
        (a history read would not, and a photo that kills the worker must reach the cap)."""
        rows: Any = await self.client.xpending_range(
            self.stream, self.group, "-", "+", count, consumername=self.consumer
        )
        if not rows:
            return []
        ids = [row["message_id"] for row in rows]
        reply = await self._read("XCLAIM", self.stream, self.group, self.consumer, 0, *ids)
        return _entries(reply, self.lane)

    @translated
    async def probe(self) -> None:
        """What the worker needs, not just an answer: a write in the stream's slot (a
        replica answers READONLY, a full server OOM, a revoked ACL NOPERM, a failing disk
        MISCONF, a loading node LOADING)."""
        await self.client.set(f"{self.stream}:probe:{self.consumer}", "1", px=10_000)

    async def reconnect(self) -> None:
        """Drop idle connections so the next command connects anew: to the new primary
        after a failover (DNS or Sentinel), or past a connection stuck on a demoted node."""
        with contextlib.suppress(rx.RedisError, OSError):
            pool = getattr(self.client, "connection_pool", None)
            if pool is not None:
                await pool.disconnect(inuse_connections=False)
            else:  # a cluster client re-reads the topology on its next command
                await self.client.aclose()

    @translated
    async def reclaim(self, min_idle_ms: int, count: int) -> tuple[list[Entry], list[str]]:
        """One XAUTOCLAIM step, keeping the cursor between calls (only `0-0` means a full
        pass). Returns the claimed entries and the ids of pending entries whose data was
        deleted (Redis drops those from the PEL; their photos must be re-enqueued)."""
        reply = await self._read("XAUTOCLAIM", self.stream, self.group, self.consumer,
                                 min_idle_ms, self._cursor, "COUNT", count)  # fmt: skip
        self._cursor = _text(reply[0])
        deleted = [_text(i) for i in reply[2]] if len(reply) > 2 else []
        return _entries(reply[1], self.lane), deleted

    @translated
    async def deliveries(self, entry_id: str) -> int:
        rows = await self.client.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
        return int(rows[0]["times_delivered"]) if rows else 0

    @translated
    async def heartbeat(self, entry_ids: Sequence[str]) -> set[str]:
        """Reset the idle time of in-flight entries this consumer still owns, so no other
        consumer steals them; returns those refreshed (an entry missing was taken over)."""
        return await self._refresh_owned(entry_ids, "") if entry_ids else set()

    @translated
    async def backoff(self, entry_id: str, idle_ms: int) -> bool:
        """Leave the entry pending, looking `idle_ms` old, without counting a delivery;
        False if another consumer owns it now (its backoff is not ours to set)."""
        return bool(await self._refresh_owned([entry_id], str(idle_ms)))

    @translated
    async def hand_back(self, entry_id: str, owner: str) -> bool:
        """Give an entry this consumer holds to `owner`, counting no delivery; False if this
        consumer no longer holds it."""
        args = [self.group, self.consumer, owner, entry_id]
        return bool(await self._run(_HAND_BACK, [self.stream], args))

    async def _refresh_owned(self, entry_ids: Sequence[str], idle_ms: str) -> set[str]:
        args = [self.group, self.consumer, idle_ms, *entry_ids]
        return {str(i) for i in await self._run(_REFRESH_OWNED, [self.stream], args)}

    async def _run(self, lua: str, keys: list[str], args: Sequence[str | int]) -> Any:
        """EVALSHA of one of this module's scripts (loaded on first use, and again after a
        Redis restart: redis-py falls back to EVAL on NOSCRIPT)."""
        script = self._scripts.get(lua)
        if script is None:
            script = self._scripts[lua] = self.client.register_script(lua)
        return await script(keys=keys, args=list(args))

    @translated
    async def ack(self, entry_id: str) -> None:
        with _group_may_be_gone():
            await self._run(ACK_LUA, [self.stream], [self.group, entry_id])

    def lettered_key(self, entry_id: str) -> str:
        """The mark of an entry already dead-lettered (its letter's id), in the stream's slot."""
        return f"{self.stream}:lettered:{entry_id}"

    @translated
    async def dead_letter(self, entry_id: str, fields: dict[str, str]) -> str:
        """XADD the letter, then XACK + XDEL the entry, in one script, once per entry (a
        resent call answers the first letter's id); "" (and nothing done) if another
        consumer holds the entry now. `fields` must be bounded
        (messages.DeadLetter.fields: at most 75): Lua's unpack takes about 8,000."""
        args: list[str | int] = [
            self.dead_maxlen,
            self.group,
            entry_id,
            self.consumer,
            LETTERED_TTL_S,
            *_flat(fields),
        ]
        keys = [self.dead_stream, self.stream, self.lettered_key(entry_id)]
        dead_id, error = await self._run(DEAD_LETTER_LUA, keys, args)
        if error == "not_owner":
            return ""
        if error and not _no_group(rx.ResponseError(error)):
            raise rx.ResponseError(error)
        return str(dead_id)

    @translated
    async def oldest_entry_ms(self) -> int | None:
        """Time (ms, from the id) of the oldest entry still in the work stream."""
        first = await self._read("XRANGE", self.stream, "-", "+", "COUNT", 1)
        return int(_text(first[0][0]).split("-")[0]) if first else None

    @translated
    async def missing(self, entry_ids: Sequence[str]) -> set[str]:
        """Which of these entry ids are no longer in the work stream: one script call per
        sweep page (an XRANGE per id, server-side), not one command per id."""
        if not entry_ids:
            return set()
        return {str(i) for i in await self._run(MISSING_LUA, [self.stream], entry_ids)}

    @translated
    async def pending_count(self) -> int:
        """Entries pending in every lane's stream."""
        total = 0
        for stream in self.lane_streams.values():
            total += int((await self.client.xpending(stream, self.group))["pending"])
        return total

    @translated
    async def status(self) -> dict[str, Any]:
        length = await self.client.xlen(self.stream)
        dead = await self.client.xlen(self.dead_stream)
        groups = (
            await self.client.xinfo_groups(self.stream) if length or await self._exists() else []
        )
        group = next((g for g in groups if g["name"] == self.group), None)
        consumers = await self.client.xinfo_consumers(self.stream, self.group) if group else []
        return {
            "stream": self.stream,
            "group": self.group,
            "length": int(length),
            "lag": group.get("lag") if group else None,
            "pending": int(group["pending"]) if group else 0,
            "consumers": [
                {"name": c["name"], "pending": int(c["pending"]), "idle_ms": int(c["idle"])}
                for c in consumers
            ],
            "dead_letter_stream": self.dead_stream,
            "dead_letters": int(dead),
            "lanes": {view.lane: await view.lane_status() for view in self.lanes()},
        }

    @translated
    async def undelivered(self) -> int:
        """Entries of this lane not yet delivered to the group: acked ones are deleted, so
        the stream's length less its pending entries (one script: one round trip)."""
        return int(await self._run(_UNDELIVERED, [self.stream], [self.group]))

    @translated
    async def lane_status(self) -> dict[str, Any]:
        """This lane's backlog (entries in the stream), lag (not yet delivered), pending
        (delivered, not acked) and the age of its oldest entry."""
        length = int(await self.client.xlen(self.stream))
        exists = length or await self._exists()
        groups = await self.client.xinfo_groups(self.stream) if exists else []
        group = next((g for g in groups if g["name"] == self.group), None)
        oldest_ms = await self.oldest_entry_ms() if length else None
        return {
            "stream": self.stream,
            "length": length,
            "lag": group.get("lag") if group else None,
            "pending": int(group["pending"]) if group else 0,
            "oldest_entry_ms": oldest_ms,
        }

    async def _exists(self) -> bool:
        return bool(await self.client.exists(self.stream))

    # -- consumer housekeeping and paged dead letters (issue 9) ------------------------------

    @translated
    async def remove_consumer_if_idle(self, name: str, min_idle_ms: int) -> bool:
        """XGROUP DELCONSUMER discards the consumer's pending entries, so the check (nothing
        pending, idle at least `min_idle_ms`) and the delete run as one script per lane's
        stream: an entry delivered to it in between cannot be lost. True if it was removed
        from every stream that knew it (one still holding bulk work stays there)."""
        found = [r for r in [await view._remove_if_idle(name, min_idle_ms) for view in
                             self.lanes()] if r != -1]  # fmt: skip
        return bool(found) and all(r == 1 for r in found)

    async def _remove_if_idle(self, name: str, min_idle_ms: int) -> int:
        """1 removed, 0 kept, -1 unknown in this stream."""
        try:
            args: list[str | int] = [self.group, name, min_idle_ms]
            return int(await self._run(_DELCONSUMER_IF_IDLE, [self.stream], args))
        except rx.ResponseError as exc:
            if _no_group(exc) or "no such key" in str(exc):
                return -1
            raise

    async def remove_self_if_idle(self) -> bool:
        """On a clean exit: leave the group unless this consumer still holds entries (they
        stay pending for its next start or for XAUTOCLAIM)."""
        return await self.remove_consumer_if_idle(self.consumer, 0)

    @translated
    async def dead_letter_count(self) -> int:
        return int(await self.client.xlen(self.dead_stream))

    @translated
    async def dead_letter_page(self, after: str, count: int) -> list[Entry]:
        """Dead letters oldest first, strictly after id `after` ("-" for the start), their
        fields escaped (whatever bytes another writer put there)."""
        start = "-" if after == "-" else f"({after}"
        return _entries(await self._read("XRANGE", self.dead_stream, start, "+", "COUNT", count))

    @translated
    async def replay_once(self, dead_id: str, fields: dict[str, str]) -> str | None:
        """Move one dead letter back to the work stream only if it is still there, in one
        script: two operators replaying at once (a double click) enqueue it once. The new
        entry id, or None if another replay took the letter first."""
        keys = [self.dead_stream, self.stream]
        new_id = await self._run(_REPLAY_IF_PRESENT, keys, [dead_id, *_flat(fields)])
        return str(new_id) if new_id else None

    @translated
    async def take_letter(self, dead_id: str) -> bool:
        """Delete one dead letter if it is still there (a bulk replay: the feeder enqueues
        the photo); False if another replay took it first."""
        return bool(await self.client.xdel(self.dead_stream, dead_id))


# KEYS[1] dead-letter stream, KEYS[2] work stream (one hash slot); ARGV[1] letter id, then
# the new entry's fields. Returns the new entry id, or false if the letter was gone.
_REPLAY_IF_PRESENT = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return false end
return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
"""

# KEYS[1] stream; ARGV group. XLEN less the group's pending count (0 without the group).
_UNDELIVERED = """
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if type(summary) == 'table' and summary.err then return 0 end
return redis.call('XLEN', KEYS[1]) - summary[1]
"""

# KEYS[1] stream; ARGV group, consumer, min idle ms. Returns 1 removed, 0 kept, -1 unknown.
_DELCONSUMER_IF_IDLE = """
local rows = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
for _, row in ipairs(rows) do
  local c = {}
  for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
  if c['name'] == ARGV[2] then
    if tonumber(c['pending']) == 0 and tonumber(c['idle']) >= tonumber(ARGV[3]) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
    return 0
  end
end
return -1
"""
