"""What a page read costs: page sizes clamped, filters served by an index or by a
bounded scan the page labels as partial, downloads streamed under a cap, and the overview's
counts shared by every viewer. Real PostgreSQL, Redis, S3 (moto server) and `darkroom web`."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from darkroom.errors import DatabaseUnavailableError, OriginalMissingError, OriginalTooLargeError
from darkroom.operate import ops
from darkroom.operate.finished import Finished
from darkroom.operate.web.downloads import Slots, needs_slot
from darkroom.operate.web.pages import LETTER_SCAN_MAX, MAX_PAGE_SIZE
from darkroom.operate.web.snapshot import Snapshot
from darkroom.queue.messages import Entry
from darkroom.store import db, storage, views
from darkroom.store.storage import CHUNK_BYTES
from tests.conftest import AWS_ENV, Env
from tests.faults import FakeClock
from tests.test_web import query, start_web

JPEG_HEAD = b"\xff\xd8\xff\xe0" + bytes(16)

# 20,000 photos: 10 % failed over four codes, the rest spread over the other states.
# A library as it looks: most photos processed, a tenth failed, the unfinished states rare
# (1 % each), so that a filter on one of them is served by photos_state_updated_idx.
FILL_SQL = """
INSERT INTO photos (id, original_key, processing_state, error_code, updated_at)
SELECT gen_random_uuid(), 'originals/x',
       CASE WHEN i % 10 = 0 THEN 'processing_failed' WHEN i % 100 = 1 THEN 'uploaded'
            WHEN i % 100 = 2 THEN 'processing' ELSE 'processed' END,
       CASE WHEN i % 10 = 0 THEN (ARRAY['timeout', 'corrupt_image', 'unsupported_format',
                                        'original_missing'])[1 + (i / 10) % 4] END,
       now() - i * interval '1 second'
FROM generate_series(1, $1) AS i
"""


FAILED_SQL = (
    "SELECT error_code, count(*) AS n FROM photos"
    " WHERE processing_state = 'processing_failed' GROUP BY 1"
)


def add_photo(env: Env, data: bytes | None = None, size: int = 0) -> uuid.UUID:
    """A photo row whose original is `data`, or a sparse file of `size` bytes that starts
    like a JPEG (no disk used, read back as zeros)."""
    photo_id = uuid.uuid4()
    key = f"originals/{photo_id}/big.jpg"
    path = env.tmp / "var" / "storage" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if data is not None else JPEG_HEAD)
        if size:
            f.truncate(size)
    query(env, "INSERT INTO photos (id, original_key) VALUES ($1, $2)", photo_id, key)
    return photo_id


def add_letters(env: Env, codes: list[str]) -> list[str]:
    """Dead letters with these codes, oldest first; their ids."""
    pipe = env.redis.pipeline(transaction=False)
    for code in codes:
        pipe.xadd(env.dead, {"photo_id": str(uuid.uuid4()), "error_code": code, "error": "x"})
    return [str(entry_id) for entry_id in pipe.execute()]


def holding(url: str, count: int) -> list[int]:
    """The statuses of `count` downloads of `url` open at once (each read no further than
    its headers, then dropped)."""
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(timeout=30)) for _ in range(count)]
        return [stack.enter_context(c.stream("GET", url)).status_code for c in clients]


def eventually_all_served(url: str, count: int, timeout_s: float = 10) -> bool:
    """True once `count` downloads at once are all served (a gone client's slot is back)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if holding(url, count) == [200] * count:
            return True
        time.sleep(0.2)
    return False


def web_rss_peak_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]


# -- page sizes -------------------------------------------------------------------------------


def test_a_page_size_above_the_max_is_clamped(file_env: Env) -> None:
    """`limit` above 500 is clamped to 500 (photos and dead letters, HTML and JSON); the next
    page continues where it stopped; a limit that is not a positive number is a 400."""
    query(file_env, FILL_SQL.replace("$1", "600"))
    ids = add_letters(file_env, ["timeout"] * 600)
    base = start_web(file_env)
    first = httpx.get(f"{base}/api/photos", params={"limit": "100000"}).json()
    assert first["limit"] == MAX_PAGE_SIZE == len(first["photos"]) and first["next"]
    rest = httpx.get(f"{base}/api/photos", params={"limit": "100000", "before": first["next"]})
    seen = {p["id"] for p in first["photos"]} | {p["id"] for p in rest.json()["photos"]}
    assert len(seen) == 600 and rest.json()["next"] is None
    html = httpx.get(f"{base}/photos", params={"limit": "100000"}).text
    assert html.count('class="photo-link"') == MAX_PAGE_SIZE and "500 photos a page" in html
    letters = httpx.get(f"{base}/api/dead-letters", params={"limit": "9999"}).json()
    assert len(letters["letters"]) == letters["limit"] == MAX_PAGE_SIZE
    assert letters["next"] == ids[MAX_PAGE_SIZE - 1]
    for bad in ("0", "-1", "ten"):
        assert httpx.get(f"{base}/api/photos", params={"limit": bad}).status_code == 400


# -- filters ----------------------------------------------------------------------------------

SHAPES = [
    (None, None, "photos_updated_idx"),
    ("uploaded", None, "photos_state_updated_idx"),
    ("processing", None, "photos_state_updated_idx"),
    (None, "timeout", "photos_code_idx"),
    ("processing_failed", "corrupt_image", "photos_code_idx"),
]


@pytest.mark.parametrize(("state", "code", "index"), SHAPES)
async def test_a_filtered_photo_page_is_served_by_an_index(
    database_url: str, state: str | None, code: str | None, index: str
) -> None:
    """Over 20,000 photos, each filter of the photos page (none, a rare state, an error
    code, both) is planned on its index, a first page and a deep one, as page_photos runs
    it (a custom plan): no Seq Scan on photos. The page holds only matching photos, newest
    first."""
    pool = await db.connect(database_url, 1)
    try:
        await pool.execute(FILL_SQL, 20_000)
        await pool.execute("ANALYZE photos")
        deep = await pool.fetchrow("SELECT updated_at, id FROM photos ORDER BY updated_at LIMIT 1"
                                   " OFFSET 10000")  # fmt: skip
        sql = views.page_photos_sql(state, code is not None)
        for cursor in (views.NEWEST, tuple(deep)):
            async with pool.acquire() as conn:
                await conn.execute("SET plan_cache_mode = force_custom_plan")
                explained = await conn.fetch(f"EXPLAIN {sql}", 51, *cursor, *filter(None, [code]))
            plan = "\n".join(r[0] for r in explained)
            assert f"{index} on photos" in plan and "Seq Scan" not in plan, plan
        rows = await views.page_photos(pool, state, code, 51)
    finally:
        await pool.close()
    assert len(rows) == 51
    assert all(state in (None, r["processing_state"]) and code in (None, r["error_code"])
               for r in rows)  # fmt: skip
    assert [r["updated_at"] for r in rows] == sorted((r["updated_at"] for r in rows), reverse=True)


def test_an_error_code_filters_failed_photos_only() -> None:
    """A code with another state than processing_failed is refused, not scanned; with
    processing_failed it is the same statement as the code alone."""
    with pytest.raises(ValueError, match="failed photos"):
        views.page_photos_sql("processed", code=True)
    assert views.page_photos_sql("processing_failed", True) == views.page_photos_sql(None, True)


def test_the_dead_letter_filter_scans_a_bounded_number_and_says_the_page_is_partial(
    file_env: Env,
) -> None:
    """2,500 letters, three with the code asked for: each page reads at most 1,000 letters,
    says it is partial and where the next page continues; following the pages finds all
    three, and the last page is complete."""
    codes = ["timeout"] * 2500
    for at in (100, 1500, 2450):
        codes[at] = "corrupt_image"
    ids = add_letters(file_env, codes)
    base = start_web(file_env)
    found, after, pages = [], "", []
    while True:
        params = {"code": "corrupt_image", **({"after": after} if after else {})}
        page = httpx.get(f"{base}/api/dead-letters", params=params).json()
        pages.append((page["scanned"], page["partial"]))
        found += [letter["id"] for letter in page["letters"]]
        if page["next"] is None:
            break
        after = page["next"]
    assert found == [ids[100], ids[1500], ids[2450]]
    assert pages == [(LETTER_SCAN_MAX, True), (LETTER_SCAN_MAX, True), (500, False)]
    html = httpx.get(f"{base}/dead-letters", params={"code": "corrupt_image"}).text
    assert "Partial page: scanned 1000 entries" in html and "next page continues" in html
    assert f"after={ids[LETTER_SCAN_MAX - 1]}" in html


def test_picking_letters_stops_at_the_page_size() -> None:
    """The page takes the first `limit` letters with the code and reports how many it read."""
    entries = [Entry(f"1-{i}", {"error_code": "a" if i % 3 == 0 else "b"}) for i in range(10)]
    picked, used = ops.pick_letters(entries, "a", 2)
    assert [e.id for e in picked] == ["1-0", "1-3"] and used == 4
    assert ops.pick_letters(entries, "c", 5) == ([], 10)
    assert ops.pick_letters(entries, None, 3) == (entries[:3], 3)


# -- downloads --------------------------------------------------------------------------------


def test_a_download_beyond_the_cap_gets_503_while_others_stream(file_env: Env) -> None:
    """With DARKROOM_WEB_DOWNLOADS=2 and two large originals streaming, a third gets 503
    `downloads_busy` with Retry-After, a small object still downloads, the two finish with
    every byte, and a slot freed by a client that left serves the next download."""
    size = 64 << 20
    big = add_photo(file_env, size=size)
    small = add_photo(file_env, data=(Path(__file__).parent / "photos" / "4.webp").read_bytes())
    file_env.vars["DARKROOM_WEB_DOWNLOADS"] = "2"
    base = start_web(file_env)
    url = f"{base}/photos/{big}/original"
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(timeout=30)) for _ in "ab"]
        held = [stack.enter_context(client.stream("GET", url)) for client in clients]
        assert [r.status_code for r in held] == [200, 200]
        bodies = [r.iter_bytes() for r in held]
        firsts = [next(body) for body in bodies]
        busy = httpx.get(url)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
        assert busy.json()["code"] == "downloads_busy"
        assert httpx.get(f"{base}/photos/{small}/original").status_code == 200
        assert len(firsts[0]) + sum(len(chunk) for chunk in bodies[0]) == size
    assert eventually_all_served(url, 2), "the slot of a client that left was never given back"
    metrics = httpx.get(f"{base}/metrics").text
    assert re.search(r"darkroom_web_downloads_refused_total [1-9]", metrics)


def test_a_large_original_is_streamed_not_loaded_whole(file_env: Env) -> None:
    """Downloading a 150 MB original raises the page's peak memory by far less than its size
    (the bytes pass through in chunks), and every byte arrives."""
    size = 150 << 20
    photo_id = add_photo(file_env, size=size)
    base = start_web(file_env)
    pid = file_env.procs[-1].pid
    warm = httpx.get(f"{base}/photos/{add_photo(file_env, data=JPEG_HEAD)}/original")
    assert warm.status_code == 200
    before_kb = web_rss_peak_kb(pid)
    received = 0
    with httpx.stream("GET", f"{base}/photos/{photo_id}/original", timeout=60) as response:
        assert response.headers["content-length"] == str(size)
        for chunk in response.iter_raw():
            received += len(chunk)
    grown_mb = (web_rss_peak_kb(pid) - before_kb) / 1024
    assert received == size and grown_mb < 32, f"peak memory grew {grown_mb:.0f} MB"


async def test_a_photo_page_leaves_no_setting_on_its_pooled_connection(database_url: str) -> None:
    """page_photos plans for its own values with a transaction-local setting: the pooled
    connection (given back without a reset statement) serves the next query as it was."""
    pool = await db.connect(database_url, 1)
    try:
        await views.page_photos(pool, "processed", None, 10)
        assert await pool.fetchval("SHOW plan_cache_mode") == "auto"
    finally:
        await pool.close()


@pytest.fixture(params=["file", "s3"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[storage.Storage]:
    """The local folder, then S3 (moto server)."""
    if request.param == "file":
        yield storage.FileStorage(tmp_path)
        return
    for key, value in AWS_ENV.items():
        monkeypatch.setenv(key, value)
    bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
    opened = await storage.open_storage(f"s3://{bucket}/p", endpoint)
    yield opened
    await opened.aclose()


async def chunks_of(store: storage.Storage, key: str, max_bytes: int) -> list[bytes]:
    stream = await store.open(key, max_bytes)
    try:
        return [chunk async for chunk in _read_all(stream)]
    finally:
        stream.close()


async def _read_all(stream: storage.ObjectStream) -> AsyncIterator[bytes]:
    while chunk := await stream.read():
        yield chunk


async def test_storage_streams_an_object_in_chunks(store: storage.Storage) -> None:
    """Local folder and S3 alike: a 1 MB object arrives in several chunks of at most
    CHUNK_BYTES that add up to its bytes; a missing object is original_missing and one
    over the cap original_too_large, before any byte is read."""
    data = bytes(range(256)) * 4096
    await store.put("originals/a/b.jpg", data, "image/jpeg")
    chunks = await chunks_of(store, "originals/a/b.jpg", len(data))
    assert len(chunks) >= len(data) // CHUNK_BYTES and max(map(len, chunks)) <= CHUNK_BYTES
    assert b"".join(chunks) == data
    with pytest.raises(OriginalMissingError):
        await store.open("originals/a/none.jpg", len(data))
    with pytest.raises(OriginalTooLargeError):
        await store.open("originals/a/b.jpg", len(data) - 1)


def test_download_slots_never_exceed_their_size() -> None:
    """Slots are taken up to their size and refused beyond, until one is given back; an
    object of one chunk needs none."""
    slots = Slots(2)
    assert [slots.take() for _ in range(3)] == [True, True, False]
    slots.give()
    assert slots.take() and not slots.take()
    assert not needs_slot(CHUNK_BYTES) and needs_slot(CHUNK_BYTES + 1)


# -- the shared snapshot ----------------------------------------------------------------------


def test_overview_loads_within_the_interval_share_one_count_query(file_env: Env) -> None:
    """20 viewers at once on a cold page, then the overview twice, /api/status and /metrics
    within DARKROOM_WEB_SNAPSHOT_S: one snapshot (one count query), and its counts are the
    database's."""
    query(file_env, FILL_SQL.replace("$1", "300"))
    file_env.vars["DARKROOM_WEB_SNAPSHOT_S"] = "60"
    base = start_web(file_env)
    with ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(lambda _: httpx.get(f"{base}/api/status", timeout=30), range(20)))
    assert {s.status_code for s in statuses} == {200}
    assert httpx.get(base).status_code == httpx.get(base).status_code == 200
    metrics = httpx.get(f"{base}/metrics").text
    assert "darkroom_web_snapshots_total 1.0" in metrics
    rows = query(file_env, "SELECT processing_state, count(*) AS n FROM photos GROUP BY 1")
    assert statuses[0].json()["photos"] == {r["processing_state"]: r["n"] for r in rows}
    failed = query(file_env, FAILED_SQL)
    assert statuses[0].json()["failures"] == {r["error_code"]: r["n"] for r in failed}


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[db.Pool]:
    pool = await db.connect(database_url, 4)
    yield pool
    await pool.close()


async def test_the_snapshot_loads_once_per_interval_and_once_for_concurrent_requests(
    pool: db.Pool,
) -> None:
    """Concurrent requests on a stale snapshot wait for one load; a request within the
    interval loads nothing; one after it loads again, with the new counts."""
    clock = FakeClock()
    snapshot = Snapshot(lambda: views.photo_counts(pool), 2.0, now=clock.now)
    results: list[Any] = []

    async def view() -> None:
        results.append(await snapshot.get())

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(view)
    assert snapshot.loads == 1 and len(results) == 20 and results[0] == ({}, {})
    await db.insert_photo(pool, uuid.uuid4(), "originals/x")
    clock.t += 1.9
    assert await snapshot.get() == ({}, {}) and snapshot.loads == 1
    clock.t += 0.2
    assert await snapshot.get() == ({"uploaded": 1}, {}) and snapshot.loads == 2


async def test_a_failed_snapshot_is_kept_for_the_interval(database_url: str) -> None:
    """A database outage costs one attempt per interval, not one per viewer: every request
    within it gets database_unavailable from the same failed load."""
    missing = database_url.rsplit("/", 1)[0] + f"/darkroom_none_{uuid.uuid4().hex[:8]}"
    gone = await db.connect(missing, 1)
    try:
        clock = FakeClock()
        snapshot = Snapshot(lambda: views.photo_counts(gone), 2.0, now=clock.now)
        for _ in range(3):
            with pytest.raises(DatabaseUnavailableError):
                await snapshot.get()
        assert snapshot.loads == 1
        clock.t += 2
        with pytest.raises(DatabaseUnavailableError):
            await snapshot.get()
        assert snapshot.loads == 2
    finally:
        await gone.close()


def test_counts_fold_into_states_and_failures_by_code() -> None:
    """One GROUP BY gives both tables: states by name, failure codes most frequent first."""
    rows = [("processed", None, 5), ("processing_failed", "timeout", 1),
            ("processing_failed", "corrupt_image", 3), ("processing_failed", None, 1)]  # fmt: skip
    states, failures = views.fold_counts(rows)
    assert states == {"processed": 5, "processing_failed": 5}
    assert list(failures.items()) == [("corrupt_image", 3), ("timeout", 1), ("unknown", 1)]


async def test_counts_past_the_cap_are_the_planners_estimates(
    pool: db.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past COUNTS_CAP photos the status reads no table: it says its counts are estimates,
    and after an ANALYZE (which samples every row of a table this small) they are the
    database's counts."""
    await pool.execute(FILL_SQL, 300)
    await pool.execute("ANALYZE photos")
    monkeypatch.setattr(views, "COUNTS_CAP", 100)
    states, failures, estimated = await views.counts(pool)
    rows = await pool.fetch("SELECT processing_state, count(*)::int AS n FROM photos GROUP BY 1")
    assert estimated and states == {r["processing_state"]: r["n"] for r in rows}
    assert failures == {r["error_code"]: r["n"] for r in await pool.fetch(FAILED_SQL)}
    monkeypatch.setattr(views, "COUNTS_CAP", 300)
    assert (await views.counts(pool))[2] is False


async def test_past_the_cap_only_the_big_count_is_estimated_the_failures_stay_exact(
    pool: db.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With processed photos past COUNTS_CAP, failures that came after the last ANALYZE
    are counted at once, by code: the estimate is the processed total alone (the table's
    row estimate less the exact others)."""
    await pool.execute(FILL_SQL, 300)  # 264 processed, 30 failed, 6 queued or in progress
    await pool.execute("ANALYZE photos")
    await pool.execute(FILL_SQL.replace("i % 10 = 0", "true"), 7)  # 7 new failures
    monkeypatch.setattr(views, "COUNTS_CAP", 100)
    states, failures, estimated = await views.counts(pool)
    exact = {r["error_code"]: r["n"] for r in await pool.fetch(FAILED_SQL)}
    assert estimated and failures == dict(sorted(exact.items(), key=lambda kv: (-kv[1], kv[0])))
    assert states["processing_failed"] == 37 and states["uploaded"] + states["processing"] == 6
    assert states["processed"] == 300 - 37 - 6, "ANALYZE's 300 rows less the exact others"


async def test_a_state_the_statistics_put_past_the_cap_is_not_counted(
    pool: db.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The processed photos, past twice the cap at the last ANALYZE, are not counted at all
    (their index is not read): deleting most of them shows only after the next ANALYZE,
    while the states an operator acts on stay exact."""
    await pool.execute(FILL_SQL, 300)  # 264 processed, 30 failed, 6 queued or in progress
    await pool.execute("ANALYZE photos")
    await pool.execute(
        "DELETE FROM photos WHERE id IN (SELECT id FROM photos"
        " WHERE processing_state = 'processed' LIMIT 200)"
    )
    monkeypatch.setattr(views, "COUNTS_CAP", 100)
    states, _, estimated = await views.counts(pool)
    assert estimated and states["processed"] == 300 - 30 - 6, "the statistics' figure"
    assert states["processing_failed"] == 30
    await pool.execute("ANALYZE photos")
    states, _, estimated = await views.counts(pool)
    assert not estimated and states["processed"] == 64


async def test_the_states_an_operator_acts_on_stay_exact_however_stale_the_statistics(
    pool: db.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ANALYZE saw 300 photos queued; they were processed since, with no new ANALYZE (a
    drained backlog on a big table does not trigger one): the queue reads 0, not the
    statistics' 300."""
    await pool.execute(
        "INSERT INTO photos (id, original_key) SELECT gen_random_uuid(), 'originals/x'"
        " FROM generate_series(1, 300)"
    )
    await pool.execute("ANALYZE photos")
    await pool.execute("UPDATE photos SET processing_state = 'processed', processed_at = now()")
    monkeypatch.setattr(views, "COUNTS_CAP", 100)
    states, _, estimated = await views.counts(pool)
    assert states.get("uploaded", 0) == 0 and states["processed"] == 300
    assert estimated, "the processed count is past the cap: an estimate"


def test_failures_past_the_cap_without_a_code_stay_unknown() -> None:
    """Past the cap the codes come from ANALYZE's sample, whose common values leave NULL
    out: the failures it does not name show as `unknown`, as under the cap."""
    estimates = [("rows", None, 400.0), ("error_code", "timeout", 100.0)]
    _, failures = views.fold_estimates({"processing_failed": 400}, {"timeout": 101}, estimates, 100)
    assert failures == {"unknown": 300, "timeout": 100}


def test_the_kept_hours_follow_the_minutes_as_they_are_reread_and_leave_the_day() -> None:
    """The hour sums are kept, not summed per refresh: a minute read again replaces its
    count in its hour, and a minute past the day's window leaves its hour's sum."""
    now = datetime(2026, 12, 6, 12, 30, tzinfo=UTC)
    finished = Finished()
    old = now - timedelta(hours=25)  # past the day and the hour kept beside it
    finished.merge(now, [(old.replace(minute=0), 4, 0), (now.replace(minute=10), 2, 1),
                         (now.replace(minute=29), 5, 0)])  # fmt: skip
    assert finished.hours() == [(now.replace(minute=0), 7, 1)], "the old minute left"
    finished.merge(now + timedelta(seconds=40), [(now.replace(minute=29), 6, 0)])
    assert finished.hours() == [(now.replace(minute=0), 8, 1)], "5 replaced by 6, not added"
    assert sum(p for _, p, _ in finished.series(now)) == 8


async def test_the_throughput_charts_read_only_the_minutes_not_yet_settled(pool: db.Pool) -> None:
    """The first load reads the day; a refresh reads only the photos finished since the
    last settled minute, and its charts still count every photo: an hour-old photo once,
    a photo finished now on the refresh."""
    insert = (
        "INSERT INTO photos (id, original_key, processing_state, processed_at) VALUES"
        " (gen_random_uuid(), 'originals/x', 'processed', now() - $1 * interval '1 minute')"
    )
    for minutes_ago in (0, 5, 90, 90):
        await pool.execute(insert, minutes_ago)
    finished = Finished()
    per_minute, per_hour = await finished.charts(pool)
    assert sum(p for _, p, _ in per_minute) == 2 and sum(p for _, p, _ in per_hour) == 4
    assert finished.settled is not None
    await pool.execute(insert, 0)
    per_minute, per_hour = await finished.charts(pool)
    assert sum(p for _, p, _ in per_minute) == 3 and sum(p for _, p, _ in per_hour) == 5
    assert len(per_minute) == 60 and len(per_hour) == 24
