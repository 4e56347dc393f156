"""`darkroom erase` against real servers, on the local folder and on S3 (moto): no object of
an erased photo is left in storage, what identifies a person or place is nulled, the row is
`erased` for good (a late entry is skipped), one event and its audit rows record it; and an
erase that races a render in flight wins: the render's publish is refused and its uploads
do not survive."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from darkroom.queue.messages import task_fields
from tests.conftest import PHOTOS, Env, s3_client
from tests.faults import DenyingS3Proxy

# An iPhone JPEG with a gain map: GPS, camera, capture time, and a render slow enough
# (about a second) to stop its worker in the middle of it.
PHOTO = PHOTOS / "iphone_hdr_NO.jpg"
KEEP_GPS = {"DARKROOM_KEEP_LOCATION": "true"}
IDENTIFYING = ("taken_at_local", "taken_at", "latitude", "longitude", "camera_make",
               "camera_model", "lens_model", "exposure", "original_sha256", "thumbhash",
               "dominant_color", "renditions")  # fmt: skip
PROBE = ".darkroom-probe"


@pytest.fixture(params=["file", "s3"])
def env(request: pytest.FixtureRequest) -> Env:
    """Each test once on the local folder and once on the moto S3 server."""
    chosen: Env = request.getfixturevalue(f"{request.param}_env")
    return chosen


def stored(env: Env, photo_id: uuid.UUID) -> list[str]:
    """Every object in the storage whose key names the photo, read directly (keys as
    darkroom names them)."""
    if "DARKROOM_S3_ENDPOINT_URL" not in env.vars:
        root = env.tmp / "var" / "storage"
        found = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    else:
        client = s3_client(env.vars["DARKROOM_S3_ENDPOINT_URL"])
        bucket = env.vars["DARKROOM_STORAGE_URL"].removeprefix("s3://").split("/")[0]
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        found = [item["Key"].removeprefix("photos/") for page in pages
                 for item in page.get("Contents", [])]  # fmt: skip
    return sorted(key for key in found if str(photo_id) in key)


def row(env: Env, photo_id: uuid.UUID) -> dict[str, Any]:
    return env.query("SELECT * FROM photos WHERE id = $1", photo_id)[0]


def erase(env: Env, photo_id: uuid.UUID, *args: str) -> Any:
    return env.cli("erase", str(photo_id), "--reason", "subject access request 17", *args)


def test_erase_deletes_every_object_nulls_the_facts_and_records_it(env: Env) -> None:
    """A processed photo, erased with --original: no object of it is left (renditions of
    every generation and the original), its identifying facts are nulled, it is `erased`
    and unpublished, one `darkroom.photo.erased` event records it, and the audit trail its
    start (in the erase's commit) and its end; the photo's earlier events lose the facts."""
    [photo_id] = env.ingest([PHOTO])
    env.cli("run", "--drain", **KEEP_GPS)
    env.cli("enqueue", "--rerender", str(photo_id))  # a second generation of renditions
    env.cli("run", "--drain", **KEEP_GPS)
    before = row(env, photo_id)
    assert all(before[c] is not None for c in IDENTIFYING), "the photo had every fact"
    assert len(stored(env, photo_id)) > 4, "renditions and the original are stored"
    done = erase(env, photo_id, "--original")
    assert f"erased  {photo_id}" in done.stdout and "erased 1 photo(s)" in done.stderr
    assert stored(env, photo_id) == []
    after = row(env, photo_id)
    assert (after["processing_state"], after["visibility"]) == ("erased", "unpublished")
    assert {c: after[c] for c in IDENTIFYING} == dict.fromkeys(IDENTIFYING)
    assert after["erased_at"] is not None and after["width"] == before["width"]
    [event] = env.query("SELECT data FROM photo_events WHERE photo_id = $1 AND type = $2",
                        photo_id, "darkroom.photo.erased")  # fmt: skip
    assert "latitude" not in json.loads(event["data"])["facts"]
    earlier = env.query("SELECT data FROM photo_events WHERE photo_id = $1 AND type <> $2",
                        photo_id, "darkroom.photo.erased")  # fmt: skip
    assert len(earlier) == 2, "the two publishes' events are kept"
    assert all({"facts", "thumbhash"}.isdisjoint(json.loads(e["data"])) for e in earlier), (
        "the earlier events lost the facts too: `darkroom events` replays no location"
    )
    ended, started = json.loads(env.cli("audit", "--action", "erase", "--json").stdout)
    assert (started["outcome"], ended["outcome"]) == ("started", "done")
    assert (ended["count"], ended["reason"]) == (1, "subject access request 17")
    assert ended["selection"] == {"photo_ids": [str(photo_id)], "original": True}
    assert ended["detail"]["left"] == [], "the ending, after the deletes: none left"


def test_without_original_the_original_stays_and_a_dry_run_changes_nothing(
    file_env: Env,
) -> None:
    """--dry-run lists the objects and changes nothing (its audit row says dry_run); the
    erase without --original deletes the renditions and keeps the original; a second
    erase finds the photo already erased and writes no second event."""
    [photo_id] = file_env.ingest([PHOTO])
    file_env.cli("run", "--drain")
    objects = stored(file_env, photo_id)
    dry = erase(file_env, photo_id, "--dry-run", "--original")
    assert dry.stdout.count("would delete") == len(objects)
    assert stored(file_env, photo_id) == objects
    assert row(file_env, photo_id)["processing_state"] == "processed"
    erase(file_env, photo_id)
    assert [k for k in stored(file_env, photo_id)] == [row(file_env, photo_id)["original_key"]]
    again = erase(file_env, photo_id)
    assert f"already erased  {photo_id}" in again.stdout
    events = file_env.query("SELECT type FROM photo_events WHERE photo_id = $1", photo_id)
    assert [e["type"] for e in events].count("darkroom.photo.erased") == 1
    outcomes = [a["outcome"] for a in json.loads(file_env.cli("audit", "--json").stdout)]
    assert outcomes == ["done", "started", "done", "started", "dry_run"]


def test_a_late_entry_of_an_erased_photo_is_skipped_without_rendering(env: Env) -> None:
    """An entry of an erased photo that arrives late (a producer's retry, a replay) is
    acked as `skipped`: no render, no object written, the row stays erased; the worker
    relays the erase's event to the events stream."""
    [photo_id] = env.ingest([PHOTO])
    env.cli("run", "--drain")
    erase(env, photo_id, "--original")
    env.redis.xadd(env.stream, task_fields(photo_id))
    env.cli("run", "--drain")
    attempts = env.query("SELECT outcome FROM photo_attempts WHERE photo_id = $1 "
                         "ORDER BY id", photo_id)  # fmt: skip
    assert attempts[-1]["outcome"] == "skipped"
    assert row(env, photo_id)["processing_state"] == "erased"
    assert stored(env, photo_id) == []
    assert env.redis.xpending(env.stream, "darkroom")["pending"] == 0
    sent = env.redis.xrange(env.vars["DARKROOM_EVENTS_STREAM"])
    assert any("darkroom.photo.erased" in json.dumps(fields) for _, fields in sent)


@pytest.fixture
def stopped(env: Env) -> Iterator[list[int]]:
    """The pids the test stopped: continued at the end whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_an_erase_during_a_render_wins_and_leaves_no_object(env: Env, stopped: list[int]) -> None:
    """A worker stopped (SIGSTOP) while it renders the photo; the photo is erased; the
    worker continues: its publish is refused, it deletes what it uploaded, and no object
    of the photo is left; the photo is never published."""
    [photo_id] = env.ingest([PHOTO])
    worker = env.start("run")
    wait_for(lambda: env.query("SELECT 1 FROM photo_jobs WHERE photo_id = $1 AND "
                               "state = 'active'", photo_id), worker)  # fmt: skip
    os.kill(worker.pid, signal.SIGSTOP)
    stopped.append(worker.pid)
    time.sleep(0.3)  # a statement sent just before the stop commits all the same
    assert row(env, photo_id)["processing_state"] == "processing", "stopped mid-render"
    erase(env, photo_id)  # the original stays: the worker renders and uploads as it would
    os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: ended(env, photo_id), worker)
    assert ended(env, photo_id) == ["skipped"], "the refused publish settles the entry"
    assert stored(env, photo_id) == [row(env, photo_id)["original_key"]]
    assert row(env, photo_id)["processing_state"] == "erased"
    types = [e["type"] for e in env.query("SELECT type FROM photo_events WHERE photo_id = $1",
                                          photo_id)]  # fmt: skip
    assert types == ["darkroom.photo.erased"], "never published"


def test_s3_an_erase_while_an_upload_is_stalled_leaves_no_object(s3_env: Env) -> None:
    """The worker's 3rd rendition upload stalls (held by a proxy) after two landed; the
    erase commits and deletes what it lists; the stalled upload then lands on its retry,
    after the erase's listing: the refused publish deletes it, and nothing is left."""
    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    try:
        uploads = itertools.count()
        proxy.hold(lambda method, path: method == "PUT" and "/renditions/" in path
                   and PROBE not in path and next(uploads) >= 2)  # fmt: skip
        [photo_id] = s3_env.ingest([PHOTO])
        worker = s3_env.start("run", DARKROOM_S3_ENDPOINT_URL=proxy.url)
        wait_for(lambda: proxy.held > 0, worker)
        landed = [k for k in stored(s3_env, photo_id) if k.startswith("renditions/")]
        assert landed, "some uploads landed before the stall"
        erase(s3_env, photo_id, "--original")
        assert stored(s3_env, photo_id) == []
        proxy.release()
        wait_for(lambda: ended(s3_env, photo_id), worker)
    finally:
        proxy.close()
    assert ended(s3_env, photo_id) == ["skipped"]
    assert stored(s3_env, photo_id) == []
    assert row(s3_env, photo_id)["renditions"] is None


def ended(env: Env, photo_id: uuid.UUID) -> list[str]:
    """The outcomes of the photo's finished deliveries."""
    rows = env.query("SELECT outcome FROM photo_attempts WHERE photo_id = $1 "
                     "AND outcome <> 'running' ORDER BY id", photo_id)  # fmt: skip
    return [r["outcome"] for r in rows]


def wait_for(done: Any, worker: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert worker.poll() is None, worker.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
