"""The audit trail on `darkroom web`: the page's and the API's actions write their rows
(via `page` under the session's name, via `api` as `token`), `/audit` and `/api/audit`
list them newest first a page at a time, filtered by action and time, and the trail is
one click from the nav in a real browser (Chromium)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from playwright.sync_api import Page, expect

from darkroom.operate.web.auth import Auth, _b64
from tests.conftest import Env
from tests.test_audit_actions import bad_photos
from tests.test_web import TOKEN, page, query, start_web

__all__ = ["page"]  # the fixture
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def rows(env: Env) -> list[dict[str, Any]]:
    return query(env, "SELECT * FROM operator_actions ORDER BY id")


def test_bearer_actions_are_recorded_as_the_token_via_api(file_env: Env) -> None:
    """A script's replay, retry and restore each leave one row: operator `token`, via
    `api`, the selection and the count; a refused retry ends `refused`."""
    first, second = bad_photos(file_env, 2)
    base = start_web(file_env)
    retried = httpx.post(f"{base}/photos/{first}/retry", headers=BEARER)
    assert retried.status_code == 200
    assert httpx.post(f"{base}/photos/{first}/retry", headers=BEARER).status_code == 409
    form = {"code": "unsupported_format", "reason": "fixed decoder"}
    replayed = httpx.post(f"{base}/dead-letters/replay", headers=BEARER, data=form)
    assert replayed.json()["replayed"] == 1, "the retried photo's letter is skipped"
    restored = httpx.post(f"{base}/photos/{second}/original", headers=BEARER,
                          files={"original": b"new bytes"})  # fmt: skip
    assert restored.status_code == 200
    found = [
        (r["operator"], r["via"], r["action"], r["outcome"], r["count"]) for r in rows(file_env)
    ]
    assert found == [
        ("token", "api", "retry", "done", 1),
        ("token", "api", "retry", "refused", 0),
        ("token", "api", "dlq.replay", "done", 1),
        ("token", "api", "photo.restore", "done", 1),
    ]
    replay = rows(file_env)[2]
    assert replay["reason"] == "fixed decoder" and '"skipped": 1' in replay["detail"]
    assert str(second) in rows(file_env)[3]["selection"]


def seed(env: Env, n: int) -> None:
    """`n` rows: gc and retry by turns, oldest first."""
    values = ", ".join(
        f"('{uuid.uuid4()}', now() - interval '{n - i} minutes', 'op{i}', 'cli', "
        f"'{'gc' if i % 2 else 'retry'}', 'done', {i})"
        for i in range(n)
    )
    query(env, "INSERT INTO operator_actions (action_id, at, operator, via, action, outcome, "
               f"count) VALUES {values}")  # fmt: skip


def test_api_audit_pages_newest_first_and_filters(file_env: Env) -> None:
    """/api/audit walks the trail newest first, `limit` rows a page with a cursor to the
    next, no row twice or missed; `action` and `since` filter; a bad cursor is a 400."""
    seed(file_env, 7)
    base = start_web(file_env, token=None)
    seen, url = [], f"{base}/api/audit?limit=3"
    while url:
        page_ = httpx.get(url).json()
        seen += [r["operator"] for r in page_["actions"]]
        url = page_["next"] and f"{base}/api/audit?limit=3&before={page_['next']}"
    assert seen == [f"op{i}" for i in reversed(range(7))]
    gc_only = httpx.get(f"{base}/api/audit", params={"action": "gc"}).json()["actions"]
    assert [r["operator"] for r in gc_only] == ["op5", "op3", "op1"]
    since = query(file_env, "SELECT at FROM operator_actions WHERE operator = 'op4'")[0]["at"]
    recent = httpx.get(f"{base}/api/audit", params={"since": since.isoformat()}).json()
    assert [r["operator"] for r in recent["actions"]] == ["op6", "op5", "op4"]
    assert httpx.get(f"{base}/api/audit?before=nonsense").status_code == 400
    assert httpx.get(f"{base}/api/audit?before=9{'9' * 30}_1").status_code == 400
    assert httpx.get(f"{base}/api/audit?since=yesterday").status_code == 400
    html = httpx.get(f"{base}/audit?action=retry&limit=2", headers={"accept": "text/html"})
    assert html.text.count('class="audit-row"') == 2 and 'id="next-page"' in html.text


def test_an_operator_sees_their_named_retry_in_the_trail(file_env: Env, page: Page) -> None:
    """In Chromium: log in under a name, retry a failed photo from its page, follow the
    nav's Audit link and find the retry under that name, via `page`, ended `done`."""
    (photo_id,) = bad_photos(file_env, 1)
    base = start_web(file_env)
    page.goto(f"{base}/login?next=/photos/{photo_id}")
    page.fill("input[name=name]", "alice")
    page.fill("input[name=token]", TOKEN)
    page.click("#login-form button[type=submit]")
    expect(page.locator("#operator-name")).to_have_text("alice")
    page.click("#retry-form button[type=submit]")
    page.click("nav a[href='/audit']")
    row = page.locator("#audit tr.audit-row").first
    expect(row.locator(".operator")).to_have_text("alice")
    expect(row.locator(".via")).to_have_text("page")
    expect(row.locator(".action")).to_have_text("retry")
    expect(row.locator(".outcome")).to_have_text("done")
    page.fill("input[name=action]", "gc")
    page.click("form.filters button[type=submit]")
    expect(page.locator("#audit")).to_contain_text("no actions match")
    assert [r["operator"] for r in rows(file_env)] == ["alice"]


def test_the_session_carries_the_login_name_signed() -> None:
    """A session keeps the name given at login (dots and non-ASCII included) under its
    signature: changing it voids the cookie; a cookie signed before names existed, or a
    login with no name, acts as `operator`."""
    auth = Auth("k" * 20)
    session, cookie = auth.new_session(operator=True, name="Zoë.o'Brien")
    assert auth.read_session(cookie) == session and session.name == "Zoë.o'Brien"
    nonce, _, issued, signature = cookie.split(".")
    forged = f"{nonce}.1~{_b64(b'mallory')}.{issued}.{signature}"
    assert auth.read_session(forged) is None
    old_payload = f"{nonce}.1.{issued}"
    old = auth.read_session(f"{old_payload}.{auth._sign(old_payload)}")
    assert old is not None and old.operator and old.name == "operator"
    assert auth.new_session(operator=True, name="  ")[0].name == "operator"
    assert auth.new_session(operator=True, name="x" * 201)[0].name == "operator"
    assert auth.new_session(operator=False, name="alice")[0].name == "operator"
