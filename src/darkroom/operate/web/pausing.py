"""The page's pause and resume, behind the operator token (as actions.py's replay and
retry: a bearer token, or a logged-in session with its CSRF token). Each writes its pause,
its queue event and its audit row in one transaction (store/pauses.py), as the CLI does."""

from __future__ import annotations

import argparse

import structlog
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from darkroom.operate.pause import parse_for, selection
from darkroom.operate.web.actions import Caller, authorize, done
from darkroom.operate.web.render import deps
from darkroom.queue.lanes import parse_lane, parse_tenant
from darkroom.store import audit, pauses

log = structlog.get_logger("darkroom.web")


def scope_of(form: FormData) -> tuple[str | None, str | None]:
    """The form's lane and tenant; empty means every one (400 for a bad value)."""
    lane, tenant = str(form.get("lane") or ""), str(form.get("tenant") or "")
    try:
        return (parse_lane(lane) if lane else None), (parse_tenant(tenant) if tenant else None)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def action_of(verb: str, caller: Caller, scope: tuple[str | None, str | None]) -> audit.Action:
    """In the caller's name: the session's, or `token` for a bearer call."""
    return caller.action(verb, selection(scope))


def for_s_of(form: FormData) -> float | None:
    text = str(form.get("for") or "").strip()
    try:
        return parse_for(text) if text else None
    except argparse.ArgumentTypeError as exc:
        raise HTTPException(400, str(exc)) from None


async def pause(request: Request) -> Response:
    caller = await authorize(request)
    kind, form = caller.kind, caller.form
    scope = scope_of(form)
    action = action_of("pause", caller, scope)
    if action.reason is None:
        raise HTTPException(400, "say why: a pause needs a reason")
    row = await pauses.pause(deps(request).pool, action, scope, for_s_of(form))
    deps(request).overview.expire()  # the page shows the pause at once
    log.info("paused", via=kind, lane=scope[0], tenant=scope[1], until=str(row["until"]))
    return done(kind, "/", {"paused": 1})


async def resume(request: Request) -> Response:
    caller = await authorize(request)
    kind, scope = caller.kind, scope_of(caller.form)
    ended = await pauses.resume(deps(request).pool, action_of("resume", caller, scope), scope)
    deps(request).overview.expire()
    log.info("resumed", via=kind, lane=scope[0], tenant=scope[1], resumed=len(ended))
    return done(kind, "/", {"resumed": len(ended)})
