"""Start-up: the host/token rule, the Starlette app, its routes and security headers."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial

import anyio
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from darkroom.errors import DarkroomError
from darkroom.operate.finished import Finished
from darkroom.operate.web import actions, live, pages, pausing, retry_all, trail
from darkroom.operate.web.auth import Auth
from darkroom.operate.web.downloads import Slots
from darkroom.operate.web.render import HERE, Deps, on_dependency_error, on_http_error
from darkroom.operate.web.snapshot import Snapshot
from darkroom.services import services, storage_for
from darkroom.settings import Settings

log = structlog.get_logger("darkroom.web")

# img-src data:: the ThumbHash placeholder and the dominant colour's swatch are small PNGs
# inlined in the photo page (an image runs no script; no request, no inline style).
CSP = (
    "default-src 'none'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def cmd_web(settings: Settings, args: argparse.Namespace) -> int:
    if settings.web_token is None and not is_loopback(settings.web_host):
        print(
            f"darkroom: invalid setting DARKROOM_WEB_TOKEN: must be set to serve the page on "
            f"the non-loopback host {settings.web_host!r} (DARKROOM_WEB_HOST)",
            file=sys.stderr,
        )
        return 2
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.web_host,
        port=settings.web_port,
        log_config=None,  # darkroom's own JSON lines (AccessLog); uvicorn's errors still show
        access_log=False,
        server_header=False,
    )
    log.info("web started", host=settings.web_host, port=settings.web_port,
             read_only=settings.web_token is None)  # fmt: skip
    if not await serve_until_signalled(QuietServer(config), app.state.live.close):
        print(f"darkroom: web: cannot serve on {settings.web_host}:{settings.web_port}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


class QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # darkroom handles SIGTERM/SIGINT itself: finish requests, exit 0, as the worker


async def serve_until_signalled(
    server: uvicorn.Server, on_stop: Callable[[], None] = lambda: None
) -> bool:
    """Serve until SIGTERM/SIGINT; False if the server could not start (uvicorn logged why:
    the port is taken, say). `on_stop` ends the streams that never end by themselves."""
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    server.should_exit = True
                    on_stop()
                    return

        tg.start_soon(stop_on_signal)
        try:
            await server.serve()
        except SystemExit:  # uvicorn's way to report a failed start-up
            return False
        finally:
            tg.cancel_scope.cancel()
    return True


def create_app(settings: Settings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with (
            services(settings, 4) as (pool, streams),
            storage_for(settings) as storage,
            anyio.create_task_group() as listener,
        ):
            listener.start_soon(app.state.live.run)
            overview = Snapshot(
                partial(pages.overview_data, pool, streams, Finished()), settings.web_snapshot_s
            )
            app.state.deps = Deps(settings, pool, streams, storage, Auth(settings.web_token),
                                  overview, Slots(settings.web_downloads))  # fmt: skip
            yield
            listener.cancel_scope.cancel()

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={HTTPException: on_http_error, DarkroomError: on_dependency_error},
    )
    app.state.live = live.Hub(settings.database_url)
    app.add_middleware(SecurityHeaders)
    app.add_middleware(AccessLog)
    return app


class AccessLog:
    """One log line per request: method, path, status and duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            log.info("request", method=scope["method"], path=scope["path"], status=status,
                     seconds=round(time.monotonic() - started, 4))  # fmt: skip


class SecurityHeaders:
    """Content-Security-Policy (no inline script or style) and friends on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"x-frame-options", b"DENY"),
                ]
            await send(message)

        await self.app(scope, receive, send_with_headers)


ROUTES = [
    Route("/", pages.overview),
    Route("/api/status", pages.api_status),
    Route("/photos", pages.photos),
    Route("/api/photos", pages.api_photos),
    Route("/photos/retry-all", retry_all.confirm),
    Route("/photos/retry-all", retry_all.retry_all, methods=["POST"]),
    Route("/photos/{photo_id:uuid}", pages.photo),
    Route("/api/photos/{photo_id:uuid}", pages.api_photo),
    Route("/photos/{photo_id:uuid}/renditions/{index:int}", pages.rendition),
    Route("/photos/{photo_id:uuid}/original", pages.original),
    Route("/photos/{photo_id:uuid}/original", actions.restore_original, methods=["POST"]),
    Route("/photos/{photo_id:uuid}/retry", actions.retry, methods=["POST"]),
    Route("/photos/{photo_id:uuid}/erase", actions.erase_photo, methods=["POST"]),
    Route("/dead-letters", pages.dead_letter_list),
    Route("/api/dead-letters", pages.api_dead_letters),
    Route("/dead-letters/replay", actions.replay, methods=["POST"]),
    Route("/audit", trail.audit_list),
    Route("/api/audit", trail.api_audit),
    Route("/pauses", pausing.pause, methods=["POST"]),
    Route("/pauses/resume", pausing.resume, methods=["POST"]),
    Route("/login", actions.login_page),
    Route("/login", actions.login, methods=["POST"]),
    Route("/logout", actions.logout, methods=["POST"]),
    Route("/metrics", pages.queue_metrics),
    Route("/livez", pages.livez),
    Route("/readyz", pages.readyz),
    Route("/live", live.live),
    Route("/favicon.ico", pages.favicon),
    Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
]
