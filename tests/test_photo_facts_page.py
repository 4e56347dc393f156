"""The photo page's facts and attempt timeline, in Debian's Chromium and
over /api/photos/<id>: the iPhone 6 photo shows its camera and capture time, its
placeholder and colour swatch load as images, and its delivery is in the timeline."""

from __future__ import annotations

import httpx
from playwright.sync_api import Page, expect

from tests import test_web
from tests.conftest import PHOTOS, Env
from tests.test_web import SCREENSHOTS, start_web

page = test_web.page  # the browser fixture, shared


def test_the_iphone_photo_page_shows_its_camera_time_placeholder_and_timeline(
    file_env: Env, page: Page
) -> None:
    """Camera `Apple iPhone 6`, taken 2015-04-10 20:12:23 local (18:12:22 UTC), the
    ThumbHash drawn at the photo's aspect ratio, the swatch, one `published` attempt."""
    (photo_id,) = file_env.ingest([PHOTOS / "iphone_hdr_NO.jpg"])
    file_env.cli("run", "--drain")
    base = start_web(file_env)
    page.goto(f"{base}/photos/{photo_id}")
    expect(page.locator("#camera")).to_have_text("Apple iPhone 6")
    expect(page.locator("#taken")).to_contain_text("2015-04-10 20:12:23")
    expect(page.locator("#taken-instant")).to_contain_text("2015-04-10 18:12:22+00:00")
    width, height = page.locator("#placeholder").evaluate(
        "(img) => [img.naturalWidth, img.naturalHeight]"
    )
    assert width == 32 and 20 <= height <= 26  # 3264×2448 is 4:3: a 32×24 placeholder
    expect(page.locator("#dominant img.swatch")).to_have_js_property("naturalWidth", 1)
    rows = page.locator("#attempts-timeline tr.outcome")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("published")
    if SCREENSHOTS:
        page.screenshot(path=f"{SCREENSHOTS}/web-photo-facts.jpg", full_page=True, quality=78)


def test_the_api_carries_the_same_facts_and_timeline(file_env: Env) -> None:
    """/api/photos/<id>: the same facts (readable and stored) and the attempts."""
    (photo_id,) = file_env.ingest([PHOTOS / "iphone_hdr_NO.jpg"])
    file_env.cli("run", "--drain")
    base = start_web(file_env)
    photo = httpx.get(f"{base}/api/photos/{photo_id}").json()
    facts = photo["facts"]
    assert facts["camera"] == "Apple iPhone 6" and facts["original_sha256"]
    assert facts["taken_at_local"].startswith("2015-04-10T20:12:23")
    assert facts["dominant_color"].startswith("#") and facts["swatch"].startswith("data:")
    assert facts["has_alpha"] is False and facts["frames"] == 1
    attempt = photo["attempts"][0]
    assert attempt["outcome"] == "published" and attempt["render_ms"] > 0
