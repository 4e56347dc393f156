"""The operator's page updates live from photo events (Server-Sent Events at /live): over
plain HTTP, and in Chromium (the overview's numbers and a photo's page)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
from playwright.sync_api import Page, expect

from darkroom.store import db, leases, publishing
from tests.conftest import Env
from tests.test_events import publish_photos
from tests.test_web import page, start_web

__all__ = ["page"]  # the Chromium fixture of test_web
T = TypeVar("T")


def photos_in_processing(url: str, count: int) -> list[leases.Claim]:
    """New photos, each claimed through entry 1-0 (the claim names the photo and its token)."""

    async def go() -> list[leases.Claim]:
        pool = await db.connect(url, 2)
        try:
            claims = []
            for photo_id in [uuid.uuid4() for _ in range(count)]:
                await db.insert_photo(pool, photo_id, f"originals/{photo_id}")
                claims.append(await leases.claim(pool, photo_id, "1-0", "w1"))
            return claims
        finally:
            await pool.close()

    return in_thread(go)


def in_thread(go: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Playwright's sync API runs an event loop in the test's thread: run ours beside it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, go()).result()


def publish(url: str, claim: leases.Claim) -> None:
    async def go() -> None:
        pool = await db.connect(url, 1)
        try:
            facts = {"width": 4, "height": 3, "format": "jpeg", "bytes": 9}
            lease = (claim.token, "1-0")
            done = await publishing.publish(pool, claim.photo_id, facts, "[]", lease)
            assert done.status == "published"
        finally:
            await pool.close()

    in_thread(go)


def test_live_streams_each_commit_as_a_photo_event(file_env: Env) -> None:
    """/live is an event stream: a publish arrives as `event: photo` with its photo id."""
    base = start_web(file_env, token=None)
    time.sleep(1)  # the page's listener connects after /livez answers
    with httpx.stream("GET", f"{base}/live", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        (photo_id,) = publish_photos(file_env.database_url, 1)
        lines = response.iter_lines()
        while next(lines) != "event: photo":
            pass
        notice = json.loads(next(lines).removeprefix("data: "))
    assert notice["photo_id"] == str(photo_id) and notice["type"] == "darkroom.photo.published"


def test_a_photo_page_and_the_overview_update_when_the_photo_is_published(
    file_env: Env, page: Page
) -> None:
    """No reload: the photo's state changes on its page, the overview's count follows."""
    first, second = photos_in_processing(file_env.database_url, 2)
    base = start_web(file_env, token=None)
    page.goto(f"{base}/photos/{first.photo_id}")
    expect(page.locator("#state")).to_have_text("processing")
    expect(page.locator("#live")).to_have_attribute("data-live-open", "true")
    publish(file_env.database_url, second)  # another photo's event: this page stays
    publish(file_env.database_url, first)
    expect(page.locator("#state")).to_have_text("processed", timeout=10_000)
    page.goto(base)
    expect(page.locator("#live")).to_have_attribute("data-live-open", "true")
    photos_in_processing(file_env.database_url, 1)
    (third,) = photos_in_processing(file_env.database_url, 1)
    publish(file_env.database_url, third)
    # within the snapshot's age plus a second, before the 5 s periodic refresh
    expect(page.locator('td[data-state="processed"]')).to_have_text("3", timeout=4_000)


def test_sigterm_ends_open_live_streams_and_the_server_exits(file_env: Env) -> None:
    """An open /live stream never holds a stop: the server exits 0 at once."""
    base = start_web(file_env, token=None)
    proc = file_env.procs[-1]
    with httpx.stream("GET", f"{base}/live", timeout=10) as response:
        assert next(response.iter_lines()) == "retry: 3000"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
