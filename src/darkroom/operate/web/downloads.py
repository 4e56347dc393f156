"""Originals and renditions, streamed from storage chunk by chunk, never loaded whole.

An object larger than one chunk holds a download slot until its last byte is sent or the
client goes away; with DARKROOM_WEB_DOWNLOADS slots taken, the next one is refused at once
(`downloads_busy`: 503 with Retry-After). An object of one chunk (a thumbnail) is one
read and holds no slot, so a page of thumbnails never waits behind a large download.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from darkroom import metrics
from darkroom.errors import DownloadsBusyError, OriginalMissingError, OriginalTooLargeError
from darkroom.store.storage import CHUNK_BYTES, ObjectStream, Storage

RETRY_AFTER_S = 5


class Slots:
    """At most `size` held at once. Taking never waits: a full house is the caller's 503."""

    def __init__(self, size: int) -> None:
        self.size, self.held = size, 0

    def take(self) -> bool:
        if self.held >= self.size:
            return False
        self.held += 1
        return True

    def give(self) -> None:
        self.held -= 1


def needs_slot(size: int) -> bool:
    return size > CHUNK_BYTES


class ObjectResponse(StreamingResponse):
    """Streams the chunks, then runs `done` (close the object, give the slot back) however
    the response ended: sent, client gone, or storage failing mid-way."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        done: Callable[[], None],
        media_type: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(chunks, media_type=media_type, headers=headers)
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._done()


async def _chunks(stream: ObjectStream, first: bytes) -> AsyncIterator[bytes]:
    chunk = first
    while chunk:
        yield chunk
        chunk = await stream.read()


async def open_object(storage: Storage, key: str, max_bytes: int) -> ObjectStream:
    """A missing or oversized object is the photo's problem (404/413), not an outage (503)."""
    try:
        return await storage.open(key, max_bytes)
    except OriginalMissingError as exc:
        raise HTTPException(404, f"{exc.code}: {exc}") from None
    except OriginalTooLargeError as exc:
        raise HTTPException(413, f"{exc.code}: {exc}") from None


async def stream_object(
    storage: Storage, slots: Slots, key: str, max_bytes: int
) -> tuple[ObjectStream, bytes, Callable[[], None]]:
    """The open object, its first chunk (to sniff), and what ends the download. Raises
    DownloadsBusyError, with nothing left open, when a large object finds no free slot."""
    stream = await open_object(storage, key, max_bytes)
    slot = needs_slot(stream.size)
    if slot and not slots.take():
        stream.close()
        metrics.WEB_DOWNLOADS_REFUSED.inc()
        raise DownloadsBusyError(f"{slots.size} downloads in progress (DARKROOM_WEB_DOWNLOADS)")

    def done() -> None:
        stream.close()
        if slot:
            slots.give()

    try:
        first = await stream.read()
    except BaseException:  # cancelled too: nothing may stay open or held
        done()
        raise
    return stream, first, done


def object_response(
    stream: ObjectStream, first: bytes, done: Callable[[], None], media_type: str,
    headers: dict[str, str],
) -> ObjectResponse:  # fmt: skip
    headers = {**headers, "content-length": str(stream.size)}
    return ObjectResponse(_chunks(stream, first), done, media_type, headers)
