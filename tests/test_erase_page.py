"""Erasing a photo from its page, in Chromium (as tests/test_web.py drives it): the form asks
for a reason and the typed word `erase`, then the photo's objects are gone, its row is
`erased` and the audit trail names the page's operator."""

from __future__ import annotations

from playwright.sync_api import Page, expect

from tests.conftest import Env
from tests.test_erase import PHOTO, stored
from tests.test_web import log_in, page, query, start_web

__all__ = ["page"]  # the browser fixture, shared with tests/test_web.py


def test_an_operator_erases_a_photo_from_its_page(file_env: Env, page: Page) -> None:
    """A processed photo: without the typed confirmation the browser does not submit (the
    photo keeps every object); with it the notice counts the deleted objects, the page
    shows the photo erased with no erase form left, no object of it (original included)
    remains, and one audit row says who erased it and why."""
    [photo_id] = file_env.ingest([PHOTO])
    file_env.cli("run", "--drain")
    before = stored(file_env, photo_id)
    assert any(k.startswith("renditions/") for k in before), before
    base = start_web(file_env)
    log_in(page, base, f"/photos/{photo_id}")
    form = page.locator("#erase-form")
    form.locator("input[name=reason]").fill("subject access request 17")
    form.locator("input[name=original]").check()
    form.locator("input[name=confirm]").fill("delete")  # not the word asked for
    form.locator("button[type=submit]").click()
    expect(form).to_be_visible()
    assert stored(file_env, photo_id) == before, "an unconfirmed erase changed storage"
    form.locator("input[name=confirm]").fill("erase")
    form.locator("button[type=submit]").click()
    expect(page.locator("#notice")).to_contain_text(f"Erased: {len(before)} object(s) deleted")
    expect(page.locator("#erase-form")).to_have_count(0)
    assert stored(file_env, photo_id) == []
    [erased] = query(file_env, "SELECT processing_state FROM photos WHERE id = $1", photo_id)
    assert erased["processing_state"] == "erased"
    trail = query(file_env, "SELECT action, via, operator, count, reason FROM operator_actions"
                            " WHERE action = 'erase' AND outcome = 'done'")  # fmt: skip
    assert [(r["via"], r["operator"], r["count"], r["reason"]) for r in trail] == [
        ("page", "operator", 1, "subject access request 17")]  # fmt: skip
