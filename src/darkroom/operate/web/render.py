"""Pages and errors: the app's dependencies, templates with the session's CSRF token,
the session cookie, and error pages (HTML for browsers, JSON for scripts)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.templating import Jinja2Templates

from darkroom.errors import DarkroomError, DownloadsBusyError
from darkroom.operate.web.auth import COOKIE, SESSION_MAX_AGE_S, Auth
from darkroom.operate.web.downloads import RETRY_AFTER_S, Slots
from darkroom.operate.web.snapshot import Snapshot
from darkroom.queue.streams import Streams
from darkroom.settings import Settings, redact
from darkroom.store import db
from darkroom.store.storage import Storage

HERE = resources.files("darkroom.operate.web")
TEMPLATES = Jinja2Templates(directory=str(HERE / "templates"))


@dataclass
class Deps:
    settings: Settings
    pool: db.Pool
    streams: Streams
    storage: Storage
    auth: Auth
    # the overview's numbers (pages.overview_data), shared by every viewer and scraper
    overview: Snapshot[dict[str, Any]]
    downloads: Slots


def deps(request: Request) -> Deps:
    found: Deps = request.app.state.deps
    return found


def render(request: Request, template: str, status: int = 200, **context: Any) -> Response:
    """A page with the session's CSRF token; a visitor without a session gets one."""
    auth = deps(request).auth
    session = auth.read_session(request.cookies.get(COOKIE))
    cookie = None
    if auth.enabled and session is None:
        session, cookie = auth.new_session(operator=False)
    context |= {
        "read_only": not auth.enabled,
        "operator": bool(session and session.operator),
        "operator_name": session.name if session and session.operator else "",
        "csrf": auth.csrf_token(session) if session else "",
        "path": request.url.path,
        "status": status,
    }
    response = TEMPLATES.TemplateResponse(request, template, context, status_code=status)
    response.headers["cache-control"] = "no-store"
    if cookie:
        set_session_cookie(request, response, cookie)
    return response


def set_session_cookie(request: Request, response: Response, value: str) -> None:
    response.set_cookie(
        COOKIE,
        value,
        max_age=SESSION_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if wants_html(request):
        response = render(request, "error.html", exc.status_code, message=exc.detail)
    else:
        response = JSONResponse({"error": exc.detail}, exc.status_code)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def on_dependency_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DarkroomError)
    message = redact(f"{exc.code}: {exc}")
    if wants_html(request):
        response = render(request, "error.html", 503, message=message)
    else:
        response = JSONResponse({"error": message, "code": exc.code}, 503)
    if isinstance(exc, DownloadsBusyError):
        response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response


def json_response(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")
