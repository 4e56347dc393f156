"""A darkroom producer (redis-py + asyncpg): store the original, insert the row, XADD.

    python produce.py photo.jpg            # the three steps of the README's producer contract
    python produce.py --pg-only photo.jpg  # no Redis: darkroom's PostgreSQL intake enqueues it

Settings are darkroom's own: DARKROOM_DATABASE_URL, DARKROOM_REDIS_URL, DARKROOM_STREAM and
DARKROOM_STORAGE_URL (a local folder, `file:PATH`; on S3, PUT the original at the same key).
Traced: TRACEPARENT (a W3C traceparent), or the current OpenTelemetry span when the
OpenTelemetry API is installed and configured (`opentelemetry-instrument python produce.py`),
goes on the row and the entry, so darkroom's spans join that trace. Prints the photo id.
"""

import asyncio
import contextlib
import os
import pathlib
import sys
import uuid
from urllib.parse import urlsplit

import asyncpg
import redis.asyncio as redis

DATABASE_URL = os.environ.get("DARKROOM_DATABASE_URL", "postgresql://postgres@127.0.0.1/darkroom")
REDIS_URL = os.environ.get("DARKROOM_REDIS_URL", "redis://127.0.0.1:6379/0")
STREAM = os.environ.get("DARKROOM_STREAM", "{darkroom}:photos")
STORAGE = urlsplit(os.environ.get("DARKROOM_STORAGE_URL", "file:./var/storage"))


def trace_context() -> dict[str, str]:
    """The W3C fields darkroom reads (docs/tracing.md); {} untraced."""
    if os.environ.get("TRACEPARENT"):
        return {"traceparent": os.environ["TRACEPARENT"]}
    try:
        from opentelemetry import propagate
    except ImportError:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)  # nothing without a configured SDK and an active span
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


def producer_span() -> contextlib.AbstractContextManager[object]:
    """A producer span around the three steps when OpenTelemetry is installed (a no-op span
    unless an SDK is configured)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return contextlib.nullcontext()
    kind = trace.SpanKind.PRODUCER
    return trace.get_tracer("darkroom-example").start_as_current_span("photos publish", kind=kind)


def store(path: pathlib.Path, key: str) -> None:
    target = pathlib.Path(STORAGE.netloc + STORAGE.path, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(path.read_bytes())


async def produce(path: pathlib.Path, pg_only: bool) -> uuid.UUID:
    photo_id = uuid.uuid4()
    key = f"originals/{photo_id}/{path.name}"
    traced = trace_context()
    await asyncio.to_thread(store, path, key)  # 1. the original, before anything names it
    db = await asyncpg.connect(DATABASE_URL)
    try:  # 2. the row; PostgreSQL-only: enqueued_at NULL ("in no stream yet", the intake's
        # cue), else now() (this producer XADDs it next, so the intake leaves it alone)
        await db.execute(
            "INSERT INTO photos (id, original_key, enqueued_at, traceparent)"
            " VALUES ($1, $2, CASE WHEN $3 THEN NULL ELSE now() END, $4)",
            photo_id, key, pg_only, traced.get("traceparent"),
        )  # fmt: skip
    finally:
        await db.close()
    if not pg_only:  # 3. the entry, only after the row's commit
        async with redis.Redis.from_url(REDIS_URL) as r:
            await r.xadd(STREAM, {"photo_id": str(photo_id), **traced})
    return photo_id


if __name__ == "__main__":
    pg_only = "--pg-only" in sys.argv
    for name in (arg for arg in sys.argv[1:] if arg != "--pg-only"):
        with producer_span():
            print(asyncio.run(produce(pathlib.Path(name), pg_only)))
