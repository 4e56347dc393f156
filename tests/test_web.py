"""The operator's web page, in a real browser (Debian's Chromium driven by Playwright) and
over plain HTTP: the app runs as `darkroom web` against the test's database and Redis,
with a real worker where photos must be processed."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.conftest import PHOTOS, Env, free_port, s3_client

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TOKEN = "test-operator-token-" + uuid.uuid4().hex
# DARKROOM_TEST_SCREENSHOTS=docs writes the screenshots of docs/operations.md there.
SCREENSHOTS = os.environ.get("DARKROOM_TEST_SCREENSHOTS")


@pytest.fixture
def page(file_env: Env) -> Iterator[Page]:
    """A fresh Chromium page. Playwright's sync API keeps an event loop running in this
    thread, so it starts after the test's database exists and stops before it is dropped
    (and direct queries during a test go through `query`, in a thread)."""
    assert Path(CHROMIUM).exists(), "install Debian's chromium (make test does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        opened = context.new_page()
        opened.set_default_timeout(20_000)
        yield opened
        browser.close()


def query(env: Env, sql: str, *params: Any) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(env.query, sql, *params).result()


def start_web(env: Env, token: str | None = TOKEN) -> str:
    """`darkroom web` on a free port; returns its base URL once /livez answers."""
    port = free_port()
    extra = {"DARKROOM_WEB_PORT": str(port), "DARKROOM_LOG_LEVEL": "warning"}
    proc = env.start("web", **extra, **({"DARKROOM_WEB_TOKEN": token} if token else {}))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/livez", timeout=1).status_code == 200:
                return base
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "darkroom web did not start"
        time.sleep(0.1)


def failed_and_processed(env: Env) -> tuple[uuid.UUID, uuid.UUID]:
    """One processed photo and one failed (`unsupported_format`: a text file), drained."""
    bad = env.tmp / "notes.jpg"
    bad.write_text("not a picture")
    good_id, bad_id = env.ingest([PHOTOS / "Landscape_3.jpg", bad])
    env.cli("run", "--drain")
    return good_id, bad_id


def state_of(env: Env, photo_id: uuid.UUID) -> str:
    rows = query(env, "SELECT processing_state FROM photos WHERE id = $1", photo_id)
    return str(rows[0]["processing_state"])


def log_in(page: Page, base: str, next_path: str = "/") -> None:
    page.goto(f"{base}/login?next={next_path}")
    page.fill("input[name=token]", TOKEN)
    page.click("#login-form button[type=submit]")
    expect(page.locator(".badge.op")).to_be_visible()


def test_overview_shows_what_the_database_holds(file_env: Env, page: Page) -> None:
    """The overview's backlog, dead letters, photos by state and failures by code are the
    numbers Redis and PostgreSQL hold."""
    failed_and_processed(file_env)
    file_env.ingest([PHOTOS / "4.webp"])  # waiting in the backlog
    base = start_web(file_env)
    page.goto(base)
    expect(page.locator("#backlog")).to_have_text(str(file_env.redis.xlen(file_env.stream)))
    expect(page.locator("#dead-letters")).to_have_text(str(file_env.redis.xlen(file_env.dead)))
    by_state = query(file_env, "SELECT processing_state, count(*) AS n FROM photos GROUP BY 1")
    assert len(by_state) == 3
    for row in by_state:
        cell = page.locator(f"#states [data-state={row['processing_state']}]")
        expect(cell).to_have_text(str(row["n"]))
    expect(page.locator("#failures [data-code=unsupported_format]")).to_have_text("1")
    expect(page.locator("svg.chart rect.ok").first).to_be_attached()
    [feeder] = query(file_env, "SELECT holder, token FROM darkroom_duties WHERE name = 'feeder'")
    expect(page.locator("#duties")).to_contain_text(feeder["holder"])
    if SCREENSHOTS:
        page.screenshot(path=f"{SCREENSHOTS}/web-overview-test.png", full_page=True)


def test_failed_photo_is_found_from_the_failures_by_code_link(file_env: Env, page: Page) -> None:
    """Failures by code links to the failed photos; the photo's page says why it failed."""
    _, bad_id = failed_and_processed(file_env)
    base = start_web(file_env)
    page.goto(base)
    page.click("#failures a:text('unsupported_format')")
    expect(page.locator("h1")).to_contain_text("unsupported_format")
    page.click(f"a.photo-link:has-text('{bad_id}')")
    expect(page.locator("#error-code")).to_have_text("unsupported_format")
    expect(page.locator("#state")).to_have_text("processing_failed")
    expect(page.locator("#last-error")).not_to_be_empty()
    expect(page.locator("img.original")).to_have_count(1)  # a text file: shown as its alt text


def test_processed_photo_page_shows_its_renditions(file_env: Env, page: Page) -> None:
    """Each rendition is served from storage with its content type and loads in the browser
    at the size recorded for it."""
    good_id, _ = failed_and_processed(file_env)
    base = start_web(file_env)
    page.goto(f"{base}/photos/{good_id}")
    images = page.locator("img.rendition")
    expect(images).to_have_count(4)
    page.wait_for_load_state("networkidle")
    widths = images.evaluate_all("(imgs) => imgs.map((img) => img.naturalWidth)")
    renditions = httpx.get(f"{base}/api/photos/{good_id}").json()["renditions"]
    assert widths == [r["width"] for r in renditions] and min(widths) > 0
    served = httpx.get(base + renditions[0]["url"])
    assert served.headers["content-type"] == f"image/{renditions[0]['format']}"
    if SCREENSHOTS:
        page.screenshot(path=f"{SCREENSHOTS}/web-photo.jpg", full_page=True, quality=80)


def test_operator_restores_the_original_replays_it_and_watches_it_processed(
    file_env: Env, page: Page
) -> None:
    """From the page alone: log in, replace a failed photo's original, replay its dead
    letter, and the overview refreshes itself to show the photo processed."""
    _, bad_id = failed_and_processed(file_env)
    base = start_web(file_env)
    file_env.start("run")
    log_in(page, base, f"/photos/{bad_id}")
    expect(page.locator("#error-code")).to_have_text("unsupported_format")
    page.set_input_files("#restore-form input[type=file]", str(PHOTOS / "Landscape_5.jpg"))
    page.uncheck("#restore-form input[name=retry]")  # the replay below requeues it
    page.click("#restore-form button[type=submit]")
    expect(page.locator("#notice")).to_contain_text("Original replaced")
    assert state_of(file_env, bad_id) == "processing_failed", "restoring alone requeues nothing"
    page.goto(f"{base}/dead-letters")
    page.click("#replay-form button[type=submit]")
    expect(page.locator("#notice")).to_contain_text("Replayed 1 letter")
    page.goto(base)
    expect(page.locator("#states [data-state=processed]")).to_have_text("2", timeout=60_000)
    page.wait_for_function("document.getElementById('live').dataset.refreshedAt")
    assert state_of(file_env, bad_id) == "processed"
    assert file_env.redis.xlen(file_env.dead) == 0
    page.goto(f"{base}/photos/{bad_id}")
    expect(page.locator("img.rendition")).to_have_count(4)


def test_a_form_without_its_csrf_token_is_refused(file_env: Env, page: Page) -> None:
    """A logged-in operator's form posted without (or with a wrong) CSRF token is refused
    with 403 and changes nothing."""
    failed_and_processed(file_env)
    base = start_web(file_env)
    log_in(page, base, "/dead-letters")
    page.evaluate("document.querySelector('#replay-form input[name=csrf]').remove()")
    with page.expect_response(f"{base}/dead-letters/replay") as posted:
        page.click("#replay-form button[type=submit]")
    assert posted.value.status == 403
    expect(page.locator("#error")).to_contain_text("CSRF")
    status = page.evaluate(
        """async () => (await fetch('/dead-letters/replay', {method: 'POST',
             body: new URLSearchParams({csrf: 'forged'})})).status"""
    )
    assert status == 403
    assert file_env.redis.xlen(file_env.dead) == 1


def test_actions_answer_401_without_and_403_with_a_wrong_token(file_env: Env) -> None:
    """No credentials: 401; a wrong bearer token: 403; neither changes anything. The right
    token replays, retries, restores and erases (JSON for scripts)."""
    _, bad_id = failed_and_processed(file_env)
    base = start_web(file_env)
    replay = f"{base}/dead-letters/replay"
    assert httpx.post(replay).status_code == 401
    assert httpx.post(replay, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert httpx.post(f"{base}/photos/{bad_id}/retry").status_code == 401
    assert file_env.redis.xlen(file_env.dead) == 1 and state_of(file_env, bad_id) != "uploaded"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    restored = httpx.post(f"{base}/photos/{bad_id}/original", headers=auth,
                          files={"original": (PHOTOS / "4.webp").read_bytes()})  # fmt: skip
    assert restored.status_code == 200 and restored.json()["retried"] is False
    answer = httpx.post(replay, headers=auth, data={"code": "unsupported_format"})
    assert answer.status_code == 200 and answer.json()["replayed"] == 1
    assert state_of(file_env, bad_id) == "uploaded" and file_env.redis.xlen(file_env.dead) == 0
    again = httpx.post(f"{base}/photos/{bad_id}/retry", headers=auth)
    assert again.status_code == 409, "only a failed photo can be retried"
    erase = f"{base}/photos/{bad_id}/erase"
    form = {"reason": "a script's erase", "confirm": "erase"}
    assert httpx.post(erase, data=form).status_code == 401
    assert httpx.post(erase, headers=auth, data={"reason": "x"}).status_code == 400
    erased = httpx.post(erase, headers=auth, data=form)
    assert erased.status_code == 200 and erased.json()["erased"] is True
    assert state_of(file_env, bad_id) == "erased"


def test_json_api_returns_the_status_and_a_photo(file_env: Env) -> None:
    """/api/status and /api/photos/<id> return the page's data as JSON."""
    good_id, bad_id = failed_and_processed(file_env)
    base = start_web(file_env)
    status = httpx.get(f"{base}/api/status").json()
    assert status["photos"] == {"processed": 1, "processing_failed": 1}
    assert status["failures"] == {"unsupported_format": 1} and status["dead_letters"] == 1
    assert sum(p for _, p, _ in status["throughput"]["per_minute"]) == 1
    assert len(status["throughput"]["per_hour"]) == 24
    assert {"feeder", "relay", "sweep"} <= {d["name"] for d in status["duties"]}
    photo = httpx.get(f"{base}/api/photos/{bad_id}").json()
    assert (photo["error_code"], photo["attempt"]) == ("unsupported_format", 1)
    assert photo["last_error"] and photo["renditions"] == []
    assert httpx.get(f"{base}/api/photos/{uuid.uuid4()}").status_code == 404
    metrics = httpx.get(f"{base}/metrics").text
    assert 'darkroom_photos{state="processed"} 1.0' in metrics
    assert "darkroom_photos_estimated 0.0" in metrics, "one photo is counted, not estimated"
    assert "darkroom_dead_letters 1.0" in metrics
    original = httpx.get(f"{base}/photos/{good_id}/original")
    assert original.headers["content-type"] == "image/jpeg"
    text_original = httpx.get(f"{base}/photos/{bad_id}/original")
    assert text_original.headers["content-disposition"] == "attachment"
    for path in (file_env.tmp / "var" / "storage" / "originals" / str(bad_id)).iterdir():
        path.unlink()
    gone = httpx.get(f"{base}/photos/{bad_id}/original")
    assert gone.status_code == 404 and "original_missing" in gone.json()["error"]


def test_without_a_token_the_page_is_read_only(file_env: Env, page: Page) -> None:
    """No DARKROOM_WEB_TOKEN: the page says it is read-only and every action is refused."""
    _, bad_id = failed_and_processed(file_env)
    base = start_web(file_env, token=None)
    page.goto(f"{base}/dead-letters")
    expect(page.locator("#read-only")).to_contain_text("read-only")
    expect(page.locator("#replay-form")).to_have_count(0)
    answer = httpx.post(f"{base}/photos/{bad_id}/retry", headers={"Authorization": "Bearer x"})
    assert answer.status_code == 403 and state_of(file_env, bad_id) == "processing_failed"


def test_a_non_loopback_host_without_a_token_refuses_to_start(file_env: Env) -> None:
    """Serving beyond loopback without a token is a settings error (exit 2)."""
    result = file_env.cli("web", check=False, DARKROOM_WEB_HOST="0.0.0.0", timeout=30)
    assert result.returncode == 2
    assert "DARKROOM_WEB_TOKEN" in result.stderr and "Traceback" not in result.stderr
    short = file_env.cli("web", check=False, DARKROOM_WEB_TOKEN="short", timeout=30)
    assert short.returncode == 2 and "short" not in short.stderr, "the token is never echoed"


def test_the_session_cookie_is_httponly_and_strict(file_env: Env) -> None:
    """The login sets an HttpOnly, SameSite=Strict session cookie without the token in it;
    a wrong token, or a login form without its CSRF token, gets 403."""
    base = start_web(file_env)
    with httpx.Client(base_url=base) as client:
        login = client.get("/login")
        csrf = login.text.split('name="csrf" value="')[1].split('"')[0]
        assert client.post("/login", data={"token": TOKEN}).status_code == 403, "no CSRF token"
        wrong = client.post("/login", data={"csrf": csrf, "token": "nope", "next": "/"})
        assert wrong.status_code == 403
        ok = client.post("/login", data={"csrf": csrf, "token": TOKEN, "next": "//evil"})
        assert ok.status_code == 303 and ok.headers["location"] == "/"
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and TOKEN not in cookie


def test_a_non_ascii_cookie_or_token_is_not_logged_in_never_a_500(file_env: Env) -> None:
    """A session cookie, CSRF field or token holding a Latin-1 byte (a stray cookie from
    another app on the host, a mangled paste) is not ours: pages answer 200 with a fresh
    session, an action 401 (no credentials) or 403 (wrong ones), never 500."""
    base = start_web(file_env)
    stray = {"cookie": b"darkroom_session=abc.1.1700000000.sig\xe9"}
    for path in ("/", "/photos", "/dead-letters", "/login"):
        page = httpx.get(base + path, headers=stray)
        assert page.status_code == 200, path
        assert "darkroom_session=" in page.headers["set-cookie"], "a fresh session"
    retry = f"{base}/photos/{uuid.uuid4()}/retry"
    assert httpx.post(retry, headers=stray).status_code == 401
    assert httpx.post(retry, headers={"authorization": b"Bearer \xe9t\xe9"}).status_code == 403
    with httpx.Client(base_url=base) as client:
        client.get("/login")
        answer = client.post("/login", data={"csrf": "\u00e9t\u00e9", "token": TOKEN})
        assert answer.status_code == 403 and "CSRF" in answer.text


def test_renditions_are_served_from_s3(s3_env: Env) -> None:
    """With S3 storage the page serves the very bytes of each rendition object."""
    (photo_id,) = s3_env.ingest([PHOTOS / "4.webp"])
    s3_env.cli("run", "--drain")
    base = start_web(s3_env)
    renditions = httpx.get(f"{base}/api/photos/{photo_id}").json()["renditions"]
    bucket, prefix = s3_env.vars["DARKROOM_STORAGE_URL"].removeprefix("s3://").split("/", 1)
    client = s3_client(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    for rendition in renditions:
        served = httpx.get(base + rendition["url"])
        stored = client.get_object(Bucket=bucket, Key=f"{prefix}/{rendition['key']}")
        assert served.content == stored["Body"].read()
        assert served.headers["content-type"] == f"image/{rendition['format']}"


def test_photo_pages_follow_each_other_without_gaps(file_env: Env, page: Page) -> None:
    """The photos list pages newest first; following "older" links visits every photo once,
    and the state filter keeps to its photos."""
    ids = file_env.ingest(
        [PHOTOS / "4.webp", PHOTOS / "Landscape_1.jpg", PHOTOS / "Landscape_2.jpg"]
    )
    base = start_web(file_env)
    page.goto(f"{base}/photos?limit=2")
    seen: list[str] = []
    while True:
        seen += page.locator("a.photo-link code").all_inner_texts()
        if not page.locator("#next-page").count():
            break
        page.click("#next-page")
    assert sorted(seen) == sorted(map(str, ids)) and seen == list(reversed([str(i) for i in ids]))
    page.goto(f"{base}/photos?state=processed")
    expect(page.locator("a.photo-link")).to_have_count(0)


def test_sigterm_stops_the_page_cleanly_and_a_taken_port_is_a_clear_error(file_env: Env) -> None:
    """SIGTERM ends `darkroom web` with exit 0; a second one on the same port exits 1 with
    a message, no traceback."""
    base = start_web(file_env)
    port = base.rsplit(":", 1)[1]
    taken = file_env.cli("web", check=False, timeout=30, DARKROOM_WEB_PORT=port)
    assert taken.returncode == 1 and "cannot serve on" in taken.stderr
    assert "Traceback" not in taken.stderr
    web = file_env.procs[-1]
    web.send_signal(signal.SIGTERM)
    web.communicate(timeout=30)
    assert web.returncode == 0


def test_operator_erases_a_photo_from_its_page(file_env: Env, page: Page) -> None:
    """A logged-in operator erases a processed photo with its original from its page
    (reason given, `erase` typed to confirm): the page says so, the photo is `erased`, no
    object of it is left in the folder, and the audit row names the page and the login name
    (`operator`: none was given)."""
    good_id, _ = failed_and_processed(file_env)
    base = start_web(file_env)
    log_in(page, base, f"/photos/{good_id}")
    page.fill("#erase-form input[name=reason]", "user asked to be forgotten")
    page.check("#erase-form input[name=original]")
    page.click("#erase-form button[type=submit]")  # not typed: the browser refuses it
    assert state_of(file_env, good_id) == "processed"
    page.fill("#erase-form input[name=confirm]", "erase")
    page.click("#erase-form button[type=submit]")
    expect(page.locator("#notice")).to_contain_text("Erased")
    expect(page.locator("#state")).to_have_text("erased")
    expect(page.locator("#erase-form")).to_have_count(0)
    assert state_of(file_env, good_id) == "erased"
    root = file_env.tmp / "var" / "storage"
    assert [p for p in root.rglob("*") if p.is_file() and str(good_id) in str(p)] == []
    [row] = query(file_env, "SELECT operator, via, reason, outcome FROM operator_actions "
                  "WHERE action = 'erase' AND outcome <> 'started'")  # fmt: skip
    assert dict(row) == {"operator": "operator", "via": "page",
                         "reason": "user asked to be forgotten", "outcome": "done"}  # fmt: skip
