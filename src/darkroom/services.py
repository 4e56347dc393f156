"""Opening and closing the adapters for one command: Redis streams, the Postgres pool
and storage."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable

import anyio

from darkroom.queue.lanes import streams_of
from darkroom.queue.streams import Streams, connect
from darkroom.settings import Settings
from darkroom.store import db
from darkroom.store.storage import Storage, open_storage

# A stop must end: closing a connection to a server that stopped answering waits forever.
CLOSE_TIMEOUT_S = 5.0


def open_streams(settings: Settings) -> Streams:
    return Streams(
        connect(settings.redis_url),
        settings.stream,
        settings.group,
        settings.consumer,
        settings.dead_letter_stream,
        settings.dead_letter_maxlen,
        {lane: key for lane, key in streams_of(settings).items()},
    )


@contextlib.asynccontextmanager
async def services(settings: Settings, pool_size: int) -> AsyncIterator[tuple[db.Pool, Streams]]:
    streams = open_streams(settings)
    try:
        pool = await db.connect(settings.database_url, pool_size)
        try:
            yield pool, streams
        finally:
            if not await _within(CLOSE_TIMEOUT_S, pool.close()):
                pool.terminate()  # a frozen server never answers the goodbye
    finally:
        await _within(CLOSE_TIMEOUT_S, streams.client.aclose())


@contextlib.asynccontextmanager
async def storage_for(settings: Settings) -> AsyncIterator[Storage]:
    storage = await open_storage(
        settings.storage_url, settings.s3_endpoint_url, settings.storage_probe_key
    )
    try:
        yield storage
    finally:
        await _within(CLOSE_TIMEOUT_S, storage.aclose())


async def _within(seconds: float, closing: Awaitable[None]) -> bool:
    """Close politely, but never let an unresponsive server hold the exit: False if the
    deadline passed (the process is exiting; the OS closes what is left)."""
    with anyio.move_on_after(seconds):
        await closing
        return True
    return False
