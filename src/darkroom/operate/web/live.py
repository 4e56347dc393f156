"""Live updates for the operator's page (Server-Sent Events at /live): one LISTEN on
darkroom_events per web process, on its own connection, fanned out to every open page
through a bounded queue each. A page too slow to drain its queue gets one `resync` in place
of the backlog; so does every page after the listener reconnects (it may have missed some).
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator

import anyio
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from darkroom.errors import DarkroomError
from darkroom.queue.pacing import Backoff
from darkroom.store import outbox

log = structlog.get_logger("darkroom.web")

MAX_PAGES = 100  # open /live streams per web process; one more is a 503
QUEUE_SIZE = 16
KEEPALIVE_S = 15.0  # a comment line this often: proxies keep the stream, the page sees it lives
RESYNC = "resync"


class Subscriber:
    def __init__(self) -> None:
        self.queue: collections.deque[str] = collections.deque()
        self.ready = anyio.Event()

    def offer(self, notice: str) -> None:
        """Never blocks the listener: a full queue becomes one `resync`."""
        if len(self.queue) >= QUEUE_SIZE:
            self.queue.clear()
            notice = RESYNC
        self.queue.append(notice)
        self.ready.set()

    async def take(self, timeout_s: float) -> list[str]:
        with anyio.move_on_after(timeout_s):
            await self.ready.wait()
        self.ready = anyio.Event()
        taken = list(self.queue)
        self.queue.clear()
        return taken


class Hub:
    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.pages: set[Subscriber] = set()
        self.closing = False

    def broadcast(self, notice: str) -> None:
        for page in self.pages:
            page.offer(notice)

    async def run(self) -> None:
        """Listen until cancelled; reconnect with backoff after a loss."""
        backoff = Backoff()
        while True:
            try:
                await self._listen(backoff)
            except DarkroomError as exc:
                log.warning("live listener lost", error_code=exc.code, error=str(exc))
            except Exception:  # a bug must not end the page: the listener backs off
                log.exception("live listener failed unexpectedly")
            await anyio.sleep(backoff.next_s())

    async def _listen(self, backoff: Backoff) -> None:
        lost = anyio.Event()

        def heard(payload: str | None) -> None:
            self.broadcast(payload) if payload is not None else lost.set()

        async with outbox.listening(self.database_url, heard) as conn:
            self.broadcast(RESYNC)  # anything may have happened while nobody listened
            backoff.reset()
            while not lost.is_set():
                with anyio.move_on_after(KEEPALIVE_S):
                    await lost.wait()
                await outbox.ping(conn)  # a silent network loss shows here

    def subscribe(self) -> Subscriber:
        if len(self.pages) >= MAX_PAGES:
            raise HTTPException(503, "too many live pages open", {"retry-after": "30"})
        page = Subscriber()
        self.pages.add(page)
        return page

    def close(self) -> None:
        """The server stops: every stream ends (a browser reconnects to the next server)."""
        self.closing = True
        for page in self.pages:
            page.ready.set()


def frame(notice: str) -> str:
    """Pure: one SSE message; a photo's notice is its JSON (id, photo_id, type)."""
    if notice == RESYNC:
        return "event: resync\ndata: {}\n\n"
    return f"event: photo\ndata: {notice}\n\n"


async def live(request: Request) -> Response:
    hub: Hub = request.app.state.live
    page = hub.subscribe()  # a 503 now, before the response starts

    async def frames() -> AsyncIterator[str]:
        try:
            yield "retry: 3000\n\n"
            while not hub.closing:
                yield "".join(map(frame, await page.take(KEEPALIVE_S))) or ": keepalive\n\n"
        finally:
            hub.pages.discard(page)

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"cache-control": "no-store"})  # fmt: skip
