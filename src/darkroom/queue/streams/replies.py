"""Redis replies as Streams reads them, and the feeder's word between workers and the
feeder: which consumers of a lane are live, and when a worker took entries of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from redis import exceptions as rx
from redis.client import NEVER_DECODE

from darkroom.queue.streams.connection import Client, translated


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


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _by_stream(reply: Any) -> list[tuple[str, Any]]:
    """XREADGROUP's reply as (stream, raw entries) pairs, RESP2 list or RESP3 map alike."""
    if isinstance(reply, dict):  # RESP3 (redis-py 8's default): a map {stream: entries}
        reply = list(reply.items())
    return [(_text(stream), raw) for stream, raw in reply or []]


class LaneSignals:
    """Mixed into Streams (a view of one lane's stream): the reserve's inputs."""

    client: Client
    stream: str
    group: str
    consumer: str
    lane_streams: dict[str, str]

    @translated
    async def join(self) -> None:
        """This consumer in every lane's group now, not at its first entry (Redis makes a
        consumer only once it gets one): the feeder counts it from its start."""
        for stream in self.lane_streams.values():
            with _group_may_be_gone():
                await self.client.xgroup_createconsumer(stream, self.group, self.consumer)

    @property
    def taken_key(self) -> str:
        """Where readers of this lane say they took entries (the stream's hash tag kept)."""
        return f"{self.stream}:taken"

    @translated
    async def say_taken(self, count: int) -> None:
        """Entries of this lane were taken: the feeder tops the lane up at once. One small
        entry, the last one only (nobody reads the history)."""
        await self.client.xadd(self.taken_key, {"n": count}, maxlen=1, approximate=False)

    @translated
    async def wait_taken(self, after: str, block_ms: int) -> str:
        """Block until entries are said taken after the signal `after` ('$': from now);
        the last signal's id, or `after` if none came within `block_ms`."""
        reply = await self.client.execute_command("XREAD", "COUNT", 1, "BLOCK", block_ms,
                                 "STREAMS", self.taken_key, after,
                                                **{NEVER_DECODE: True})  # fmt: skip
        ids = [_text(i) for _, raw in _by_stream(reply) for i, _ in raw or []]
        return ids[-1] if ids else after

    @translated
    async def live_consumers(self, idle_ms: int) -> int:
        """Consumers of this lane's group seen (a read, a claim, a heartbeat) within
        `idle_ms`; none while the group is gone."""
        with _group_may_be_gone():
            rows = await self.client.xinfo_consumers(self.stream, self.group)
            return sum(1 for row in rows if int(row["idle"]) < idle_ms)
        return 0
