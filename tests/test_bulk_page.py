"""The photos page's "retry all N matching" in Chromium: the count shown before the
confirm, the retry behind the token with CSRF, and its rows in the audit trail."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

from playwright.sync_api import Page, expect

from tests import test_web
from tests.conftest import Env
from tests.test_bulk import mixed_rows, seed_sync
from tests.test_web import log_in, query, start_web

page = test_web.page  # the Chromium page fixture

CODE = "render_timeout"
FAILED_OF_CODE = (
    "SELECT count(*) AS n FROM photos"
    " WHERE processing_state = 'processing_failed' AND error_code = $1"
)


def open_confirm(env: Env, page: Page) -> int:
    """Seeded failures; the operator logs in, filters by code and opens the confirm page."""
    rows = mixed_rows()
    with ThreadPoolExecutor(1) as pool:  # Playwright's event loop runs in this thread
        pool.submit(seed_sync, env, rows).result()
    base = start_web(env)
    log_in(page, base, quote(f"/photos?state=processing_failed&code={CODE}"))
    page.click("#retry-all-link")
    return sum(r["code"] == CODE for r in rows)


def test_retry_all_matching_shows_the_count_then_retries_them(file_env: Env, page: Page) -> None:
    """The confirm page shows the exact count; the form retries exactly those photos (the
    other code's stay failed) and the trail records it as the page's, with the reason."""
    n = open_confirm(file_env, page)
    expect(page.locator("#match-count")).to_contain_text(f"{n} failed photo(s) match")
    page.fill("#retry-all-form input[name=reason]", "timeouts raised")
    page.click("#retry-all-form button[type=submit]")
    expect(page.locator("#notice")).to_contain_text(f"Retried {n} of {n} photo(s)")
    expect(page.locator("#match-count")).to_contain_text("0 failed photo(s) match")
    assert query(file_env, FAILED_OF_CODE, CODE)[0]["n"] == 0
    assert query(file_env, FAILED_OF_CODE, "decode_failed")[0]["n"] > 0
    trail = query(
        file_env, "SELECT via, operator, outcome, count, reason FROM operator_actions ORDER BY id"
    )
    assert [(r["via"], r["operator"], r["outcome"], r["count"]) for r in trail] == [
        ("page", "operator", "started", n), ("page", "operator", "done", n)]  # fmt: skip
    assert trail[0]["reason"] == "timeouts raised"


def test_retry_all_without_its_csrf_token_is_refused(file_env: Env, page: Page) -> None:
    """The form posted without its CSRF token answers 403 and retries nothing."""
    n = open_confirm(file_env, page)
    page.evaluate("document.querySelector('#retry-all-form input[name=csrf]').remove()")
    with page.expect_response(lambda r: r.url.endswith("/photos/retry-all")) as posted:
        page.click("#retry-all-form button[type=submit]")
    assert posted.value.status == 403
    assert query(file_env, FAILED_OF_CODE, CODE)[0]["n"] == n
    assert query(file_env, "SELECT count(*) AS n FROM operator_actions")[0]["n"] == 0
