"""Actions behind the operator token: replay dead letters, retry a photo, restore its
original, erase a photo, each recorded in the audit trail (via `page` for a session, under its name;
`api` for a bearer call, as `token`); and the login/logout forms that set the session
cookie."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import structlog
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from darkroom.operate import erase, ops
from darkroom.operate.audit import audited
from darkroom.operate.web.auth import COOKIE, Session, clean_name
from darkroom.operate.web.pages import photo_or_404
from darkroom.operate.web.render import deps, json_response, render, set_session_cookie
from darkroom.store.audit import Action, Via

log = structlog.get_logger("darkroom.web")
REPLAY_MAX = 1000  # letters replayed per click; the page says when more remain


@dataclass(frozen=True)
class Caller:
    """Who posted an action: `bearer` or `session`, the form, and the name the audit
    trail records (the session's, or `token` for a bearer call)."""

    kind: str
    form: FormData
    name: str

    def action(self, verb: str, selection: dict[str, Any]) -> Action:
        reason = str(self.form.get("reason") or "").strip() or None
        via: Via = "api" if self.kind == "bearer" else "page"
        return Action(operator=self.name, via=via, action=verb, selection=selection,
                      reason=reason)  # fmt: skip


async def authorize(request: Request) -> Caller:
    """The caller, with the posted form. Checks credentials before reading the body: 401
    with none, 403 with wrong ones (or a missing/wrong CSRF token)."""
    auth = deps(request).auth
    if not auth.enabled:
        raise HTTPException(403, "read-only: DARKROOM_WEB_TOKEN is not set")
    verdict = auth.bearer(request.headers.get("authorization"))
    if verdict == "wrong":
        raise HTTPException(403, "wrong token")
    session = auth.read_session(request.cookies.get(COOKIE))
    if verdict == "none" and not (session and session.operator):
        raise HTTPException(401, "log in, or send Authorization: Bearer <token>",
                            headers={"www-authenticate": "Bearer"})  # fmt: skip
    form = await request.form(max_files=1, max_fields=20)
    if verdict == "ok":
        return Caller("bearer", form, "token")
    assert session is not None
    if not auth.csrf_ok(session, form.get("csrf")):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
    return Caller("session", form, session.name)


def done(kind: str, to: str, payload: dict[str, Any]) -> Response:
    """Scripts get JSON; a browser goes back to the page (303), which shows the result."""
    if kind == "bearer":
        return json_response(payload)
    return RedirectResponse(f"{to}?{urlencode(payload)}", 303)


async def replay(request: Request) -> Response:
    caller = await authorize(request)
    d = deps(request)
    code = str(caller.form.get("code") or request.query_params.get("code") or "") or None
    codes = [code] if code else None
    action = caller.action("dlq.replay", {"codes": codes, "limit": REPLAY_MAX})
    async with audited(d.pool, action, long=False) as tally:
        letters = [e async for e in ops.dead_letters(d.streams, codes, REPLAY_MAX)]
        for letter in letters:
            tally.count += isinstance(await ops.replay_letter(d.pool, d.streams, letter), str)
        tally.detail["skipped"] = len(letters) - tally.count
    replayed, more = tally.count, len(letters) == REPLAY_MAX
    log.info("dead letters replayed", via=caller.kind, code=code, replayed=replayed, more=more)
    payload = {"replayed": replayed, "skipped": len(letters) - replayed, "more": more}
    return done(caller.kind, "/dead-letters", {**payload, **({"code": code} if code else {})})


async def retry(request: Request) -> Response:
    caller = await authorize(request)
    d = deps(request)
    photo_id: uuid.UUID = request.path_params["photo_id"]
    async with audited(d.pool, caller.action("retry", {"photo_ids": [str(photo_id)]}),
                       long=False) as tally:  # fmt: skip
        entry_id = await ops.retry_photo(d.pool, d.streams, photo_id)
        tally.count, tally.outcome = (0, "refused") if entry_id is None else (1, "done")
    if entry_id is None:
        raise HTTPException(409, "the photo is not processing_failed; nothing to retry")
    log.info("photo retried", via=caller.kind, photo_id=str(photo_id), entry_id=entry_id)
    return done(caller.kind, f"/photos/{photo_id}", {"retried": True, "entry_id": entry_id})


async def restore_original(request: Request) -> Response:
    """Replace the bytes at the photo's original_key (the producer's file was lost or bad),
    then, if asked, retry the failed photo."""
    d = deps(request)
    limit = d.settings.max_original_bytes
    if int(request.headers.get("content-length") or 0) > limit + 65536:
        raise HTTPException(413, f"the original is larger than {limit} bytes")
    caller = await authorize(request)
    row = await photo_or_404(request)
    upload = caller.form.get("original")
    if not isinstance(upload, UploadFile):
        raise HTTPException(400, "send the file as the `original` field")
    data = await upload.read(limit + 1)
    if not data or len(data) > limit:
        raise HTTPException(400 if not data else 413, "empty file, or over the size cap")
    action = caller.action("photo.restore", {"photo_ids": [str(row["id"])],
                                             "retry": bool(caller.form.get("retry"))})  # fmt: skip
    async with audited(d.pool, action, long=False) as tally:
        await d.storage.put(row["original_key"], data, "application/octet-stream")
        retried = bool(caller.form.get("retry")) and (
            await ops.retry_photo(d.pool, d.streams, row["id"]) is not None
        )
        tally.count, tally.detail = 1, {"bytes": len(data), "retried": retried}
    log.info("original restored", via=caller.kind, photo_id=str(row["id"]),
             key=row["original_key"], bytes=len(data), retried=retried)  # fmt: skip
    return done(caller.kind, f"/photos/{row['id']}", {"restored": len(data), "retried": retried})


async def erase_photo(request: Request) -> Response:
    """`darkroom erase` of one photo, confirmed by typing `erase`, with a reason (the
    audit row, written in the erase's own commit, names the caller as the others do)."""
    caller = await authorize(request)
    d = deps(request)
    row = await photo_or_404(request)
    if caller.form.get("confirm") != "erase" or not str(caller.form.get("reason") or "").strip():
        raise HTTPException(400, "type `erase` to confirm, and give a reason")
    original = bool(caller.form.get("original"))
    action = caller.action("erase", {"photo_ids": [row["id"]], "original": original})
    tally = await erase.erase_photos(
        d.pool, d.storage, [row["id"]], action, original=original, dry_run=False,
        say=lambda _: None,
    )  # fmt: skip
    log.info("photo erased", via=caller.kind, photo_id=str(row["id"]), **tally)
    payload = {"erased": True, "deleted": tally["deleted"], "failed": tally["failed"]}
    return done(caller.kind, f"/photos/{row['id']}", payload)


def safe_next(raw: object) -> str:
    """Only a path on this site (no open redirect)."""
    text = str(raw or "/")
    return text if text.startswith("/") and not text.startswith("//") else "/"


async def login_page(request: Request) -> Response:
    if not deps(request).auth.enabled:
        raise HTTPException(404, "read-only: DARKROOM_WEB_TOKEN is not set")
    return render(request, "login.html", next=safe_next(request.query_params.get("next")))


async def login(request: Request) -> Response:
    auth = deps(request).auth
    session = auth.read_session(request.cookies.get(COOKIE))
    form = await request.form(max_files=0, max_fields=5)
    if not auth.enabled or session is None or not auth.csrf_ok(session, form.get("csrf")):
        raise HTTPException(403, "missing or wrong CSRF token: reload the login page")
    if not auth.token_matches(str(form.get("token") or "")):
        log.warning("wrong token at login", client=request.client.host if request.client else None)
        return render(request, "login.html", 403, next=safe_next(form.get("next")),
                      error="wrong token")  # fmt: skip
    response = RedirectResponse(safe_next(form.get("next")), 303)
    name = clean_name(form.get("name"))
    set_session_cookie(request, response, auth.new_session(operator=True, name=name)[1])
    log.info("operator logged in", client=request.client.host if request.client else None,
             name=name)  # fmt: skip
    return response


async def logout(request: Request) -> Response:
    auth = deps(request).auth
    session: Session | None = auth.read_session(request.cookies.get(COOKIE))
    form = await request.form(max_files=0, max_fields=5)
    if session is None or not auth.csrf_ok(session, form.get("csrf")):
        raise HTTPException(403, "missing or wrong CSRF token")
    response = RedirectResponse("/", 303)
    set_session_cookie(request, response, auth.new_session(operator=False)[1])
    return response
