"""Opening and closing the adapters for one command: Redis streams, the Postgres pool
and storage."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from darkroom import db
from darkroom.settings import Settings
from darkroom.storage import Storage, open_storage
from darkroom.streams import Streams, connect


def open_streams(settings: Settings) -> Streams:
    return Streams(
        connect(settings.redis_url),
        settings.stream,
        settings.group,
        settings.consumer,
        settings.dead_letter_stream,
        settings.dead_letter_maxlen,
    )


@contextlib.asynccontextmanager
async def services(settings: Settings, pool_size: int) -> AsyncIterator[tuple[db.Pool, Streams]]:
    streams = open_streams(settings)
    try:
        pool = await db.connect(settings.database_url, pool_size)
        try:
            yield pool, streams
        finally:
            await pool.close()
    finally:
        await streams.client.aclose()


@contextlib.asynccontextmanager
async def storage_for(settings: Settings) -> AsyncIterator[Storage]:
    storage = await open_storage(settings.storage_url, settings.s3_endpoint_url)
    try:
        yield storage
    finally:
        await storage.aclose()
