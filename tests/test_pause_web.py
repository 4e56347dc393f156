"""Pause and resume on the operator's page, in Chromium (as tests/test_web.py drives it):
the buttons behind the token, the table and /metrics that show the pause; and the page's
/readyz, which names PostgreSQL or Redis when either does not answer."""

from __future__ import annotations

import json

import httpx
from playwright.sync_api import Page, expect

from tests.conftest import Env, free_port
from tests.test_web import TOKEN, log_in, page, query, start_web

__all__ = ["page"]  # the browser fixture, shared with tests/test_web.py


def test_an_operator_pauses_and_resumes_a_tenant_from_the_page(file_env: Env, page: Page) -> None:
    """Logged in, the operator pauses bulk for acme with a reason and a time: the table,
    /metrics and the audit trail show it; the Resume button ends it, and the gauge goes."""
    file_env.cli("migrate")
    base = start_web(file_env)
    log_in(page, base)
    page.select_option("#pause-form select[name=lane]", "bulk")
    page.fill("#pause-form input[name=tenant]", "acme")
    page.fill("#pause-form input[name=reason]", "acme over quota")
    page.fill("#pause-form input[name=for]", "2h")
    page.click("#pause-form button[type=submit]")
    expect(page.locator("#notice")).to_contain_text("Paused")
    row = page.locator("#pauses tr[data-pause='bulk/acme']")
    expect(row).to_contain_text("acme over quota")
    metrics = httpx.get(f"{base}/metrics").text
    assert 'darkroom_paused{lane="bulk",tenant="acme"} 1.0' in metrics
    [paused] = query(file_env, "SELECT lane, tenant, operator, until FROM queue_pauses")
    assert (paused["lane"], paused["tenant"], paused["operator"]) == ("bulk", "acme", "operator")
    assert paused["until"] is not None
    row.locator("button[type=submit]").click()
    expect(page.locator("#notice")).to_contain_text("Resumed 1 pause")
    expect(page.locator("#pauses")).to_contain_text("nothing paused")
    assert "darkroom_paused{" not in httpx.get(f"{base}/metrics").text
    trail = query(file_env, "SELECT action, via, operator, count FROM operator_actions ORDER BY id")
    assert [(r["action"], r["via"], r["operator"], r["count"]) for r in trail] == [
        ("pause", "page", "operator", 1), ("resume", "page", "operator", 1)]  # fmt: skip


def test_pausing_from_the_page_needs_the_token_and_a_reason(file_env: Env) -> None:
    """Without credentials 401, with a wrong token 403, without a reason 400: nothing paused."""
    file_env.cli("migrate")
    base = start_web(file_env)
    assert httpx.post(f"{base}/pauses", data={"reason": "x"}).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(f"{base}/pauses", data={"reason": "x"}, headers=wrong).status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{base}/pauses", data={"lane": "bulk"}, headers=auth).status_code == 400
    bad = httpx.post(f"{base}/pauses", data={"reason": "x", "for": "3x"}, headers=auth)
    assert bad.status_code == 400
    assert not query(file_env, "SELECT 1 FROM queue_pauses")
    answer = httpx.post(f"{base}/pauses", data={"reason": "deploy"}, headers=auth)
    assert answer.status_code == 200 and answer.json() == {"paused": 1}
    assert "lane=* tenant=*  by token" in file_env.cli("status").stdout


def test_readyz_names_the_dependency_that_does_not_answer(file_env: Env) -> None:
    """The page's /readyz: 200 with both servers up; 503 naming `queue` when Redis does not
    answer and `database` when PostgreSQL does not (the pod leaves the Service)."""
    file_env.cli("migrate")
    assert httpx.get(f"{start_web(file_env)}/readyz").status_code == 200
    no_redis = f"redis://127.0.0.1:{free_port()}/0"
    file_env.vars["DARKROOM_REDIS_URL"] = no_redis
    down = httpx.get(f"{start_web(file_env)}/readyz", timeout=10)
    assert down.status_code == 503 and list(json.loads(down.text)["down"]) == ["queue"]
    file_env.vars["DARKROOM_DATABASE_URL"] = f"postgresql://postgres@127.0.0.1:{free_port()}/x"
    both = httpx.get(f"{start_web(file_env)}/readyz", timeout=10)
    assert both.status_code == 503 and set(json.loads(both.text)["down"]) == {"database", "queue"}
