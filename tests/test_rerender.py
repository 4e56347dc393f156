"""A re-render never changes what readers see until it commits: renditions go to new keys
named by their content, the commit switches the row, the replaced objects are deleted
after it, and `darkroom gc` collects what a crash or a failed delete left behind. Against
the real moto S3 server (through a fault proxy) and the local folder."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from darkroom.image import pipeline
from darkroom.operate import gc
from darkroom.settings import parse_renditions
from darkroom.store import db, storage
from tests.conftest import AWS_ENV, PHOTOS, Env, s3_client
from tests.faults import DenyingS3Proxy

PHOTO = PHOTOS / "Landscape_4.jpg"
# The default renditions at other qualities: the same names and formats, other bytes.
OTHER_QUALITY = "thumb:320:webp:60,medium:1024:webp:60,medium:1024:jpeg:60,large:2048:webp:60"
ROW = ("renditions", "width", "height", "format", "bytes", "processed_at", "rerendered_at",
       "thumbhash", "visibility", "processing_state")  # fmt: skip


# The storage probe writes inside renditions/ too: it is not a rendition upload.
PROBE = ".darkroom-probe"


def row(env: Env, photo_id: uuid.UUID) -> dict[str, Any]:
    return env.query("SELECT * FROM photos WHERE id = $1", photo_id)[0]


def referenced(env: Env, photo_id: uuid.UUID) -> set[str]:
    return {r["key"] for r in json.loads(row(env, photo_id)["renditions"])}


def log_lines(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


# -- storage: list and delete -----------------------------------------------------------------


@pytest.fixture(params=["s3", "file"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[storage.Storage]:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        opened = await storage.open_storage(f"s3://{bucket}/p", endpoint)
    else:
        opened = await storage.open_storage(f"file:{tmp_path}/storage")
    yield opened
    await opened.aclose()


async def test_storage_lists_a_prefix_page_by_page_and_deletes(
    store: storage.Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`list` pages through every object under a prefix (S3 continuation tokens, local
    folders) with sizes and write times, and nothing outside it; `delete` removes one
    object, and deleting an absent one is not an error."""
    monkeypatch.setattr("darkroom.store.storage.s3.LIST_PAGE", 3)
    monkeypatch.setattr("darkroom.store.storage.files.LIST_FOLDERS", 2)
    written = {f"renditions/{uuid.UUID(int=n)}/thumb-{n}.webp": b"x" * n for n in range(1, 8)}
    for key, data in written.items():
        await store.put(key, data, "image/webp", "public, max-age=60")
    await store.put("originals/a/b.jpg", b"original", "image/jpeg")
    pages = [page async for page in store.list("renditions/")]
    assert len(pages) > 2, "more than one page"
    listed = {obj.key: obj for page in pages for obj in page}
    assert {key: obj.size for key, obj in listed.items()} == {k: len(v) for k, v in written.items()}
    assert all(abs(obj.modified_s - time.time()) < 60 for obj in listed.values())
    gone = next(iter(written))
    await store.delete(gone)
    await store.delete(gone)
    await store.delete("renditions/never/there.webp")
    assert {obj.key async for page in store.list("renditions/") for obj in page} == set(written) - {
        gone
    }
    assert [page async for page in store.list("nothing-here/")] in ([], [[]])


async def test_storage_stat_reads_an_object_as_it_is_now(store: storage.Storage) -> None:
    """`stat` gives an object's size and write time as they are now (an overwrite renews
    the time), and None for an absent key (a longer key it prefixes is another object), on
    S3 and in the local folder alike."""
    key = f"renditions/{uuid.uuid4()}/thumb-000000000001.webp"
    await store.put(f"{key}.old", b"other", "image/webp")
    assert await store.stat(key) is None
    await store.put(key, b"xyz", "image/webp")
    found = await store.stat(key)
    assert found is not None and (found.key, found.size) == (key, 3)
    assert abs(found.modified_s - time.time()) < 60


# -- S3 (moto server) ----------------------------------------------------------------------


@pytest.fixture
def proxy(s3_env: Env) -> Iterator[DenyingS3Proxy]:
    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    yield proxy
    proxy.close()


class Bucket:
    """The test's bucket, read directly (not through the proxy)."""

    def __init__(self, env: Env) -> None:
        self.client = s3_client(env.vars["DARKROOM_S3_ENDPOINT_URL"])
        self.name = env.vars["DARKROOM_STORAGE_URL"].removeprefix("s3://").split("/")[0]

    def keys(self, photo_id: uuid.UUID) -> set[str]:
        listed = self.client.list_objects_v2(
            Bucket=self.name, Prefix=f"photos/renditions/{photo_id}/"
        )
        return {item["Key"].removeprefix("photos/") for item in listed.get("Contents", [])}

    def read(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.name, Key=f"photos/{key}")["Body"].read())

    def head(self, key: str) -> dict[str, Any]:
        return dict(self.client.head_object(Bucket=self.name, Key=f"photos/{key}"))


def test_s3_rerender_denied_half_way_changes_nothing_readers_see(
    s3_env: Env, proxy: DenyingS3Proxy
) -> None:
    """S3 denies the 3rd and later rendition uploads of a re-render: the row and the bytes
    under its keys stay exactly as they were; `gc --dry-run` keeps the fresh uploads (too
    young); the re-render run again publishes new keys (with DARKROOM_CACHE_CONTROL) and
    deletes the old objects: no orphan is left."""
    bucket = Bucket(s3_env)
    [photo_id] = s3_env.ingest([PHOTO])
    s3_env.cli("run", "--drain")
    before = row(s3_env, photo_id)
    live = {key: bucket.read(key) for key in referenced(s3_env, photo_id)}
    assert bucket.keys(photo_id) == set(live)
    uploads = itertools.count()
    proxy.deny(lambda method, path: method == "PUT" and "/renditions/" in path
               and PROBE not in path and next(uploads) >= 2)  # fmt: skip
    s3_env.cli("enqueue", "--rerender", str(photo_id))
    s3_env.cli("run", "--drain", DARKROOM_S3_ENDPOINT_URL=proxy.url,
               DARKROOM_RENDITIONS=OTHER_QUALITY, DARKROOM_MAX_ATTEMPTS="1")  # fmt: skip
    assert proxy.denied >= 1
    after = row(s3_env, photo_id)
    assert {c: after[c] for c in ROW} == {c: before[c] for c in ROW}
    # answered by the failure (the job says how): not counted in flight, not claimable again
    assert after["rerender_requested_at"] is None
    assert {key: bucket.read(key) for key in live} == live
    [job] = s3_env.query("SELECT error_code FROM photo_jobs WHERE photo_id = $1", photo_id)
    assert job["error_code"] == "object_forbidden"
    stray = bucket.keys(photo_id) - set(live)
    assert len(stray) <= 2, "only the two uploads S3 accepted"
    dry = s3_env.cli("gc", "--dry-run")
    assert "would delete 0 of" in dry.stderr and f"{len(stray)} younger than" in dry.stderr
    assert bucket.keys(photo_id) == set(live) | stray

    proxy.deny(lambda method, path: False)
    s3_env.cli("enqueue", "--rerender", str(photo_id))
    s3_env.cli("run", "--drain", DARKROOM_S3_ENDPOINT_URL=proxy.url,
               DARKROOM_RENDITIONS=OTHER_QUALITY,
               DARKROOM_CACHE_CONTROL="public, max-age=600")  # fmt: skip
    new = referenced(s3_env, photo_id)
    assert not new & set(live) and stray <= new, "the same bytes get the same key"
    assert bucket.keys(photo_id) == new, "the old objects are gone, nothing else is left"
    for key in new:
        assert bucket.head(key)["CacheControl"] == "public, max-age=600"


def test_s3_rerender_killed_half_way_changes_nothing_and_its_redelivery_leaves_no_orphan(
    s3_env: Env, proxy: DenyingS3Proxy
) -> None:
    """A worker SIGKILLed while its re-render's 3rd upload is stalled: the row and the bytes
    under its keys stay as they were; the entry is taken back, rendered again to the same
    keys and published, and the bucket then holds exactly the new keys."""
    bucket = Bucket(s3_env)
    [photo_id] = s3_env.ingest([PHOTO])
    s3_env.cli("run", "--drain")
    before = row(s3_env, photo_id)
    live = {key: bucket.read(key) for key in referenced(s3_env, photo_id)}
    uploads = itertools.count()
    proxy.hold(lambda method, path: method == "PUT" and "/renditions/" in path
               and PROBE not in path and next(uploads) >= 2)  # fmt: skip
    s3_env.cli("enqueue", "--rerender", str(photo_id))
    worker = s3_env.start("run", DARKROOM_S3_ENDPOINT_URL=proxy.url,
                          DARKROOM_RENDITIONS=OTHER_QUALITY)  # fmt: skip
    deadline = time.monotonic() + 90
    while proxy.held == 0:
        assert time.monotonic() < deadline and worker.poll() is None, "no upload stalled"
        time.sleep(0.05)
    worker.kill()
    worker.communicate(timeout=30)
    proxy.release()
    after = row(s3_env, photo_id)
    assert {c: after[c] for c in ROW} == {c: before[c] for c in ROW}
    assert {key: bucket.read(key) for key in live} == live
    [job] = s3_env.query("SELECT state FROM photo_jobs WHERE photo_id = $1", photo_id)
    assert job["state"] == "active", "the killed delivery still holds the photo (gc skips it)"
    s3_env.cli("run", "--drain", DARKROOM_RENDITIONS=OTHER_QUALITY, DARKROOM_CLAIM_IDLE_MS="1000")
    new = referenced(s3_env, photo_id)
    assert row(s3_env, photo_id)["rerendered_at"] is not None and not new & set(live)
    assert bucket.keys(photo_id) == new


def run_gc(env: Env, now_s: float, dry_run: bool) -> tuple[Counter[str], list[str]]:
    """`gc.collect` in-process against the test's database and bucket, at a chosen time."""

    async def go() -> tuple[Counter[str], list[str]]:
        store = await storage.open_storage(
            env.vars["DARKROOM_STORAGE_URL"], env.vars["DARKROOM_S3_ENDPOINT_URL"]
        )
        pool = await db.connect(env.database_url, 2)
        lines: list[str] = []
        try:
            tally = await gc.collect(pool, store, older_than_s=gc.GRACE_S, now_s=now_s,
                                     dry_run=dry_run, say=lines.append)  # fmt: skip
        finally:
            await pool.close()
            await store.aclose()
        return tally, lines

    return asyncio.run(go())


def test_s3_a_failed_delete_leaves_objects_that_gc_collects_after_the_grace(
    s3_env: Env, proxy: DenyingS3Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 denies the deletes after a re-render's commit: the photo is published anyway and
    the old objects stay; gc keeps them while younger than the grace period, lists them
    without deleting on a dry run, and then deletes exactly them (nothing referenced,
    nothing of a photo being processed)."""
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    bucket = Bucket(s3_env)
    first, busy = s3_env.ingest([PHOTO, PHOTOS / "4.webp"])
    s3_env.cli("run", "--drain")
    old = referenced(s3_env, first)
    proxy.deny(lambda method, path: method == "DELETE")
    s3_env.cli("enqueue", "--rerender", str(first))
    log = s3_env.cli("run", "--drain", DARKROOM_S3_ENDPOINT_URL=proxy.url,
                     DARKROOM_RENDITIONS=OTHER_QUALITY).stderr  # fmt: skip
    assert any(e["event"] == "superseded renditions left for darkroom gc" for e in log_lines(log))
    new = referenced(s3_env, first)
    assert row(s3_env, first)["rerendered_at"] is not None
    assert bucket.keys(first) == old | new
    # a photo a delivery is working on right now: its objects are never collected
    s3_env.query("UPDATE photo_jobs SET state = 'active' WHERE photo_id = $1", busy)
    s3_env.query("UPDATE photos SET renditions = '[]' WHERE id = $1", busy)
    later = time.time() + 2 * gc.GRACE_S

    tally, lines = run_gc(s3_env, time.time(), dry_run=False)
    assert (tally["young"], tally["deleted"]) == (len(old) + 4, 0)
    tally, lines = run_gc(s3_env, later, dry_run=True)
    assert (tally["deleted"], tally["referenced"], tally["busy"]) == (len(old), len(new), 4)
    assert sorted(line.split()[2] for line in lines) == sorted(old)
    assert all(line.startswith("would delete ") for line in lines)
    assert bucket.keys(first) == old | new
    tally, lines = run_gc(s3_env, later, dry_run=False)
    assert (tally["deleted"], tally["busy"]) == (len(old), 4)
    assert bucket.keys(first) == new and len(bucket.keys(busy)) == 4


# -- the local folder ----------------------------------------------------------------------


def folder(env: Env) -> Path:
    return env.tmp / "var" / "storage"


def files(env: Env, photo_id: uuid.UUID) -> set[str]:
    base = folder(env)
    return {str(p.relative_to(base)) for p in (base / "renditions" / str(photo_id)).iterdir()}


def age(paths: list[Path], seconds: float) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def test_local_rerender_failing_half_way_changes_nothing_readers_see(file_env: Env) -> None:
    """A folder sits where one new rendition must go (the write fails after others
    succeeded): the row and the files under its keys stay exactly as they were."""
    [photo_id] = file_env.ingest([PHOTO])
    file_env.cli("run", "--drain")
    before = row(file_env, photo_id)
    live = {key: (folder(file_env) / key).read_bytes() for key in referenced(file_env, photo_id)}
    result = pipeline.render(PHOTO.read_bytes(), parse_renditions(OTHER_QUALITY), 10**8)
    large = next(r for r in result.renditions if r.name == "large")
    blocked = f"renditions/{photo_id}/large-{large.sha256[:12]}.webp"
    (folder(file_env) / blocked).mkdir()
    file_env.cli("enqueue", "--rerender", str(photo_id))
    file_env.cli("run", "--drain", DARKROOM_RENDITIONS=OTHER_QUALITY, DARKROOM_MAX_ATTEMPTS="1")
    after = row(file_env, photo_id)
    assert {c: after[c] for c in ROW} == {c: before[c] for c in ROW}
    [job] = file_env.query("SELECT error_code FROM photo_jobs WHERE photo_id = $1", photo_id)
    assert job["error_code"] == "storage_unavailable"
    assert {key: (folder(file_env) / key).read_bytes() for key in live} == live


def test_local_rerender_with_duplicates_leaves_exactly_the_new_keys(file_env: Env) -> None:
    """A re-render delivered three times at once publishes once; the same bytes get the same
    keys, so the folder then holds exactly the keys the row references (the old ones are
    deleted, no duplicate left an orphan). A re-render with unchanged settings keeps every
    key and deletes nothing."""
    [photo_id] = file_env.ingest([PHOTO])
    file_env.cli("run", "--drain")
    old = referenced(file_env, photo_id)
    file_env.cli("enqueue", "--rerender", str(photo_id))
    file_env.cli("enqueue", str(photo_id), str(photo_id))
    log = file_env.cli("run", "--drain", DARKROOM_RENDITIONS=OTHER_QUALITY).stderr
    outcomes = [e["outcome"] for e in log_lines(log) if e["event"] == "entry done"]
    assert sorted(outcomes) == ["already", "already", "published"]
    new = referenced(file_env, photo_id)
    assert len(new) == 4 and not new & old
    assert files(file_env, photo_id) == new
    published = {key: (folder(file_env) / key).read_bytes() for key in new}
    first = row(file_env, photo_id)["rerendered_at"]
    file_env.cli("enqueue", "--rerender", str(photo_id))
    file_env.cli("run", "--drain", DARKROOM_RENDITIONS=OTHER_QUALITY)
    assert row(file_env, photo_id)["rerendered_at"] > first
    assert referenced(file_env, photo_id) == new == files(file_env, photo_id)
    assert {key: (folder(file_env) / key).read_bytes() for key in new} == published


def test_gc_deletes_only_old_unreferenced_renditions_and_old_keys_keep_working(
    file_env: Env,
) -> None:
    """Photos published before content-named keys keep their fixed keys (gc never deletes
    a referenced key); gc --dry-run lists the old orphans and deletes nothing; gc deletes
    exactly them, never a young one or a file that is not a rendition; a re-render moves a
    fixed-key photo to new keys and deletes the fixed ones."""
    legacy, current = file_env.ingest([PHOTO, PHOTOS / "4.webp"])
    file_env.cli("run", "--drain")
    base = folder(file_env)
    fixed = _as_published_before_this_change(file_env, legacy)
    gone = uuid.uuid4()  # a photo whose row was deleted
    some = next(iter(referenced(file_env, current)))
    orphans = [f"renditions/{current}/thumb-0000deadbeef.webp", f"renditions/{gone}/thumb-1.webp"]
    young = f"renditions/{current}/medium-00000000cafe.webp"
    foreign = "renditions/README.txt"
    for key in [*orphans, young, foreign]:
        (base / key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(base / some, base / key)
    age([p for p in (base / "renditions").rglob("*") if p.is_file()], 2 * gc.GRACE_S)
    age([base / young], 60)

    dry = file_env.cli("gc", "--dry-run")
    assert sorted(line.split()[2] for line in dry.stdout.splitlines()) == sorted(orphans)
    assert all(line.startswith("would delete ") for line in dry.stdout.splitlines())
    assert (
        "would delete 2 of 12 rendition objects; kept 8 referenced, 1 younger than 3600 s"
        in dry.stderr
    )
    assert all((base / key).exists() for key in orphans)

    ran = file_env.cli("gc")
    assert sorted(line.split()[1] for line in ran.stdout.splitlines()) == sorted(orphans)
    assert "deleted 2 of 12" in ran.stderr and "1 not rendition keys" in ran.stderr
    assert not any((base / key).exists() for key in orphans)
    assert all((base / key).exists() for key in [young, foreign, *fixed])
    assert file_env.cli("gc").stdout == ""

    file_env.cli("enqueue", "--rerender", str(legacy))
    file_env.cli("run", "--drain")
    new = referenced(file_env, legacy)
    assert not new & set(fixed) and files(file_env, legacy) == new


def _as_published_before_this_change(env: Env, photo_id: uuid.UUID) -> list[str]:
    """Move a photo's renditions to the fixed keys darkroom used before (`<name>.<ext>`)
    and point its row at them, as a photo published by an older darkroom is."""
    base = folder(env)
    renditions = json.loads(row(env, photo_id)["renditions"])
    for r in renditions:
        fixed = f"renditions/{photo_id}/{r['name']}.{r['key'].rsplit('.', 1)[1]}"
        (base / r["key"]).rename(base / fixed)
        r["key"] = fixed
    env.query(
        "UPDATE photos SET renditions = $2::jsonb WHERE id = $1", photo_id, json.dumps(renditions)
    )
    return [r["key"] for r in renditions]


@pytest.mark.parametrize("seconds", ["60", "-1", "nan", "soon"])
def test_gc_refuses_a_grace_shorter_than_an_upload_may_wait(file_env: Env, seconds: str) -> None:
    """`gc --older-than` below 300 s (or not a number) is refused with exit 2: a younger
    object may be an upload whose publish is about to commit."""
    result = file_env.cli("gc", "--older-than", seconds, check=False)
    assert result.returncode == 2 and "--older-than" in result.stderr


# -- gc against a photo a worker is touching ------------------------------------------------


async def gc_scene(pool: db.Pool, store: storage.Storage) -> tuple[uuid.UUID, str, str]:
    """A processed photo whose row references one rendition, beside an orphan of it; both
    objects written two grace periods ago, its job done. (photo, live key, orphan key)"""
    photo_id = uuid.uuid4()
    live, orphan = (f"renditions/{photo_id}/thumb-{n:012x}.webp" for n in (1, 2))
    await db.insert_photo(pool, photo_id, f"originals/{photo_id}/x.jpg")
    await db.record_requeued(pool, photo_id, "1-0")
    rendition = [{"name": "thumb", "format": "webp", "key": live, "width": 1, "height": 1}]
    await pool.execute(
        "UPDATE photos SET processing_state = 'processed', processed_at = now(),"
        " renditions = $2::jsonb WHERE id = $1", photo_id, json.dumps(rendition),
    )  # fmt: skip
    await pool.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = $1", photo_id)
    for key in (live, orphan):
        await store.put(key, b"webp", "image/webp")
    assert isinstance(store, storage.FileStorage)
    age([store.root / live, store.root / orphan], 2 * gc.GRACE_S)
    return photo_id, live, orphan


@pytest.fixture
async def local(
    tmp_path: Path, database_url: str
) -> AsyncIterator[tuple[db.Pool, storage.Storage]]:
    pool = await db.connect(database_url, 4)
    yield pool, storage.FileStorage(tmp_path / "storage")
    await pool.close()


async def run_collect(pool: db.Pool, store: storage.Storage) -> Counter[str]:
    return await gc.collect(pool, store, older_than_s=gc.GRACE_S, now_s=time.time(),
                            dry_run=False, say=lambda line: None)  # fmt: skip


async def test_gc_keeps_an_object_written_again_after_it_was_listed(
    local: tuple[db.Pool, storage.Storage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A render of the same bytes writes an orphan's key again after gc listed it as old:
    gc reads the object afresh before deleting it, and keeps it (young); the key the row
    references stays too."""
    pool, store = local
    _, live, orphan = await gc_scene(pool, store)
    hold_photo = db.hold_photo

    def written_again_first(pool: db.Pool, held_id: uuid.UUID) -> Any:
        async def hold() -> AsyncIterator[Any]:
            await store.put(orphan, b"webp", "image/webp")  # the same key, its bytes again
            async with hold_photo(pool, held_id) as held:
                yield held

        return contextlib.asynccontextmanager(hold)()

    monkeypatch.setattr(db, "hold_photo", written_again_first)
    tally = await run_collect(pool, store)
    assert (tally["deleted"], tally["young"], tally["referenced"]) == (0, 1, 1)
    assert await store.stat(orphan) is not None and await store.stat(live) is not None


async def _waiting_on_locks(pool: db.Pool) -> int:
    return int(await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ))  # fmt: skip


async def test_gc_sees_a_claim_that_committed_while_it_waited_for_the_photo(
    local: tuple[db.Pool, storage.Storage],
) -> None:
    """A claim holds the photo (a re-render starting) when gc comes to delete its orphan:
    gc waits, then reads the job as the claim left it (active) and deletes nothing of the
    photo, whose render may be writing that very key; then, the job done, it collects."""
    pool, store = local
    photo_id, live, orphan = await gc_scene(pool, store)
    async with pool.acquire() as claim, anyio.create_task_group() as tg:
        tally: Counter[str] = Counter()

        async def collect() -> None:
            tally.update(await run_collect(pool, store))

        async with claim.transaction():
            await claim.execute("SELECT 1 FROM photos WHERE id = $1 FOR UPDATE", photo_id)
            await claim.execute(
                "UPDATE photo_jobs SET state = 'active', lease_until = now() + interval '1 h'"
                " WHERE photo_id = $1", photo_id,
            )  # fmt: skip
            tg.start_soon(collect)
            for _ in range(3000):  # a minute at most
                if await _waiting_on_locks(pool):
                    break
                await anyio.sleep(0.02)
    assert (tally["deleted"], tally["busy"], tally["referenced"]) == (0, 1, 1)
    assert await store.stat(orphan) is not None and await store.stat(live) is not None
    await pool.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = $1", photo_id)
    assert (await run_collect(pool, store))["deleted"] == 1
    assert await store.stat(orphan) is None and await store.stat(live) is not None
