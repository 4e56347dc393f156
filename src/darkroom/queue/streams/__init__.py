"""Redis Streams I/O for one consumer: group, read, reclaim, heartbeat, ack, backoff,
dead-letter, status (`Streams`). The client of each topology and the table that turns
driver errors into QueueUnavailableError are connection.py's; the Lua that moves entries
atomically is scripts.py's.

Invariants: an entry is acked (and deleted, so the stream holds only the backlog) only
after Postgres committed its outcome; nothing pending is ever trimmed; the dead-letter
XADD and the source XACK+XDEL happen in one Lua script (keys of one hash slot); entries
are read as raw bytes (RAW_READS), so nothing a producer sends can fail a read.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Sequence
from typing import Any

from redis import exceptions as rx
from redis.client import NEVER_DECODE

from darkroom.queue.messages import Entry, received
from darkroom.queue.streams import scripts
from darkroom.queue.streams.connection import ERRORS, Client, connect, translated
from darkroom.queue.streams.replies import (
    LaneSignals,
    _by_stream,
    _group_may_be_gone,
    _no_group,
    _text,
)

# What callers import from here: the client and its error table live in connection.py.
__all__ = ["ERRORS", "Client", "Streams", "connect", "translated"]


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


# Entries are untrusted bytes: these reads answer raw, undecoded RESP (NEVER_DECODE, and
# no redis-py callback, whose dict would hide a repeated field), parsed by `_entries`.
# Decoding a reply is then never the part that fails, whatever a producer sent.
RAW_READS = ("XREADGROUP", "XAUTOCLAIM", "XCLAIM", "XRANGE", "XREAD")


def _raw(response: Any, **options: Any) -> Any:
    return response


def _entries(raw: Iterable[Any] | None, lane: str = "interactive") -> list[Entry]:
    """Entries from a raw `[[id, [name, value, ...]], ...]`. An entry deleted while pending
    comes back without fields (`[id, nil]`) and is left out: its photo is the sweep's."""
    return [received(_text(i), fields, lane) for i, fields in raw or [] if fields is not None]


class Streams(LaneSignals):
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
    async def enqueue_many(self, batch: Sequence[dict[str, str]]) -> list[str]:
        """The entries in order, pipelined (one round trip); their ids."""
        async with self.client.pipeline(transaction=False) as pipe:
            for fields in batch:
                pipe.xadd(self.stream, fields)  # type: ignore[arg-type]
            return [str(entry_id) for entry_id in await pipe.execute()]

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
        return bool(await self._run(scripts.HAND_BACK_LUA, [self.stream], args))

    async def _refresh_owned(self, entry_ids: Sequence[str], idle_ms: str) -> set[str]:
        args = [self.group, self.consumer, idle_ms, *entry_ids]
        return {str(i) for i in await self._run(scripts.REFRESH_OWNED_LUA, [self.stream], args)}

    async def _run(self, lua: str, keys: list[str], args: Sequence[str | int]) -> Any:
        """EVALSHA of one of scripts.py's scripts (loaded on first use, and again after a
        Redis restart: redis-py falls back to EVAL on NOSCRIPT)."""
        script = self._scripts.get(lua)
        if script is None:
            script = self._scripts[lua] = self.client.register_script(lua)
        return await script(keys=keys, args=list(args))

    @translated
    async def ack(self, entry_id: str) -> None:
        with _group_may_be_gone():
            await self._run(scripts.ACK_LUA, [self.stream], [self.group, entry_id])

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
            scripts.LETTERED_TTL_S,
            *_flat(fields),
        ]
        keys = [self.dead_stream, self.stream, self.lettered_key(entry_id)]
        dead_id, error = await self._run(scripts.DEAD_LETTER_LUA, keys, args)
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
        return {str(i) for i in await self._run(scripts.MISSING_LUA, [self.stream], entry_ids)}

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
        return int(await self._run(scripts.UNDELIVERED_LUA, [self.stream], [self.group]))

    @translated
    async def delivery_point(self) -> tuple[str, str | None]:
        """This stream's last generated id, and the first entry the group has not delivered
        (None: every entry was), in one script (docs/fairness.md, the duplicate rule)."""
        last, first = await self._run(scripts.DELIVERY_POINT_LUA, [self.stream], [self.group])
        return _text(last), None if first is None else _text(first)

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

    # -- consumer housekeeping, and the dead letters an operator pages through and replays --

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
            return int(await self._run(scripts.DELCONSUMER_IF_IDLE_LUA, [self.stream], args))
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
        new_id = await self._run(scripts.REPLAY_IF_PRESENT_LUA, keys, [dead_id, *_flat(fields)])
        return str(new_id) if new_id else None

    @translated
    async def take_letter(self, dead_id: str) -> bool:
        """Delete one dead letter if it is still there (a bulk replay: the feeder enqueues
        the photo); False if another replay took it first."""
        return bool(await self.client.xdel(self.dead_stream, dead_id))
