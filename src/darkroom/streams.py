"""Redis Streams I/O: group, read, reclaim, heartbeat, ack, backoff, dead-letter, status.

Invariants: an entry is acked (and deleted, so the stream holds only the backlog) only
after Postgres committed its outcome; nothing pending is ever trimmed; the dead-letter
XADD and the source XACK+XDEL happen in one MULTI. Driver errors become
QueueUnavailableError here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as redis
from redis.exceptions import RedisError, ResponseError

from darkroom.errors import QueueUnavailableError
from darkroom.messages import Entry

P = ParamSpec("P")
R = TypeVar("R")


def translated(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise QueueUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    return wrapper


def _no_group(exc: ResponseError) -> bool:
    """Redis lost the group (restarted empty): the entry is gone, Postgres will recover it."""
    return str(exc).startswith("NOGROUP")


@contextlib.contextmanager
def _group_may_be_gone() -> Iterator[None]:
    """Acting on an entry of a group Redis lost is a no-op, not an error."""
    try:
        yield
    except ResponseError as exc:
        if not _no_group(exc):
            raise


def connect(url: str) -> redis.Redis:
    # BLOCK reads stay at most 5 s (settings), well under the socket timeout.
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=15,
        socket_connect_timeout=5,
        health_check_interval=30,
    )


def _entries(raw: Iterable[Any]) -> list[Entry]:
    return [Entry(entry_id, dict(fields or {})) for entry_id, fields in raw]


class Streams:
    """One work stream + consumer group + dead-letter stream, seen by one consumer."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        dead_stream: str,
        dead_maxlen: int = 100_000,
    ) -> None:
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.dead_stream, self.dead_maxlen = dead_stream, dead_maxlen
        self._cursor = "0-0"

    @translated
    async def ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @translated
    async def enqueue(self, fields: dict[str, str]) -> str:
        return str(await self.client.xadd(self.stream, fields))  # type: ignore[arg-type]

    @translated
    async def read_new(self, count: int, block_ms: int) -> list[Entry]:
        reply: Any = await self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        return _entries(reply[0][1]) if reply else []

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
        claimed = await self.client.xclaim(self.stream, self.group, self.consumer, 0, ids)
        return [e for e in _entries(claimed) if e.fields]

    @translated
    async def ping(self) -> None:
        await self.client.ping()

    @translated
    async def reclaim(self, min_idle_ms: int, count: int) -> tuple[list[Entry], list[str]]:
        """One XAUTOCLAIM step, keeping the cursor between calls (only `0-0` means a full
        pass). Returns the claimed entries and the ids of pending entries whose data was
        deleted (Redis drops those from the PEL; their photos must be re-enqueued)."""
        reply = await self.client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_ms, self._cursor, count=count
        )
        self._cursor = reply[0]
        deleted = [str(i) for i in reply[2]] if len(reply) > 2 else []
        return [e for e in _entries(reply[1]) if e.fields], deleted

    @translated
    async def deliveries(self, entry_id: str) -> int:
        rows = await self.client.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
        return int(rows[0]["times_delivered"]) if rows else 0

    @translated
    async def heartbeat(self, entry_ids: Sequence[str]) -> None:
        """Reset idle time of in-flight entries so no other consumer steals them."""
        if entry_ids:
            with _group_may_be_gone():
                await self.client.xclaim(
                    self.stream, self.group, self.consumer, 0, list(entry_ids), justid=True
                )

    @translated
    async def backoff(self, entry_id: str, idle_ms: int) -> None:
        """Leave the entry pending, looking `idle_ms` old, without counting a delivery."""
        with _group_may_be_gone():
            await self.client.xclaim(
                self.stream, self.group, self.consumer, 0, [entry_id], idle=idle_ms, justid=True
            )

    @translated
    async def ack(self, entry_id: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, entry_id)
            pipe.xdel(self.stream, entry_id)
            with _group_may_be_gone():
                await pipe.execute()

    @translated
    async def dead_letter(self, entry_id: str, fields: dict[str, str]) -> str:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(
                self.dead_stream,
                fields,  # type: ignore[arg-type]
                maxlen=self.dead_maxlen,
                approximate=True,
            )
            pipe.xack(self.stream, self.group, entry_id)
            pipe.xdel(self.stream, entry_id)
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, ResponseError) and not _no_group(reply):
                raise reply
        return str(replies[0])

    @translated
    async def dead_letters(self, count: int) -> list[Entry]:
        return _entries(await self.client.xrange(self.dead_stream, count=count) or [])

    @translated
    async def replay(self, dead_id: str, fields: dict[str, str]) -> str:
        """Move one dead letter back to the work stream, atomically (no double replay)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.stream, fields)  # type: ignore[arg-type]
            pipe.xdel(self.dead_stream, dead_id)
            new_id, _ = await pipe.execute()
        return str(new_id)

    @translated
    async def oldest_entry_ms(self) -> int | None:
        """Time (ms, from the id) of the oldest entry still in the work stream."""
        first = await self.client.xrange(self.stream, count=1)
        return int(str(first[0][0]).split("-")[0]) if first else None

    @translated
    async def missing(self, entry_ids: Sequence[str]) -> set[str]:
        """Which of these entry ids are no longer in the work stream."""
        async with self.client.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xrange(self.stream, entry_id, entry_id, count=1)
            found = await pipe.execute()
        return {i for i, hit in zip(entry_ids, found, strict=True) if not hit}

    @translated
    async def pending_count(self) -> int:
        summary = await self.client.xpending(self.stream, self.group)
        return int(summary["pending"])

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
        }

    async def _exists(self) -> bool:
        return bool(await self.client.exists(self.stream))

    # -- consumer housekeeping and paged dead letters (issue 9) ------------------------------

    @translated
    async def remove_consumer_if_idle(self, name: str, min_idle_ms: int) -> bool:
        """XGROUP DELCONSUMER discards the consumer's pending entries, so the check (nothing
        pending, idle at least `min_idle_ms`) and the delete run as one script: an entry
        delivered to it in between cannot be lost. True if it was removed."""
        try:
            removed = await self.client.eval(
                _DELCONSUMER_IF_IDLE, 1, self.stream, self.group, name, str(min_idle_ms)
            )
        except ResponseError as exc:
            if _no_group(exc) or "no such key" in str(exc):
                return False
            raise
        return int(removed) == 1

    async def remove_self_if_idle(self) -> bool:
        """On a clean exit: leave the group unless this consumer still holds entries (they
        stay pending for its next start or for XAUTOCLAIM)."""
        return await self.remove_consumer_if_idle(self.consumer, 0)

    @translated
    async def dead_letter_page(self, after: str, count: int) -> list[Entry]:
        """Dead letters oldest first, strictly after id `after` ("-" for the start)."""
        start = "-" if after == "-" else f"({after}"
        return _entries(await self.client.xrange(self.dead_stream, start, "+", count=count) or [])

    @translated
    async def replay_once(self, dead_id: str, fields: dict[str, str]) -> str | None:
        """Move one dead letter back to the work stream only if it is still there, in one
        script: two operators replaying at once (a double click) enqueue it once. The new
        entry id, or None if another replay took the letter first."""
        flat = [item for pair in fields.items() for item in pair]
        new_id = await self.client.eval(
            _REPLAY_IF_PRESENT, 2, self.dead_stream, self.stream, dead_id, *flat
        )
        return str(new_id) if new_id else None


# KEYS[1] dead-letter stream, KEYS[2] work stream (one hash slot); ARGV[1] letter id, then
# the new entry's fields. Returns the new entry id, or false if the letter was gone.
_REPLAY_IF_PRESENT = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return false end
return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
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
