"""`darkroom erase --tenant ...` (the same run as `darkroom bulk erase`) against real
servers, on the local folder and on S3 (moto): no object of a photo it erased is left
(renditions of every generation, originals with --original, a render's uploads in flight),
each photo erased once even across a SIGKILL and a rerun, the count and the trail exact,
and the id form untouched."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PHOTOS, Env
from tests.faults import DenyingS3Proxy
from tests.test_erase import PHOTO, PROBE, ended, row, stopped, stored, wait_for
from tests.test_feeder import wait_for as wait_until

__all__ = ["stopped"]  # the fixture, used by name

SMALL = [PHOTOS / "Landscape_1.jpg", PHOTOS / "Landscape_3.jpg", PHOTOS / "4.webp"]
REASON = ("--reason", "account closed")
ERASED_EVENTS = """
SELECT photo_id, count(*)::int AS n FROM photo_events
WHERE type = 'darkroom.photo.erased' GROUP BY 1
"""


@pytest.fixture(params=["file", "s3"])
def env(request: pytest.FixtureRequest) -> Env:
    """Each test once on the local folder and once on the moto S3 server."""
    chosen: Env = request.getfixturevalue(f"{request.param}_env")
    return chosen


def ingest(env: Env, tenant: str, paths: list[Path]) -> list[uuid.UUID]:
    out = env.cli("ingest", "--tenant", tenant, *map(str, paths)).stdout.split()
    return [uuid.UUID(line) for line in out]


def trail(env: Env) -> list[dict[str, Any]]:
    """The bulk erases' audit rows, oldest first."""
    sql = ("SELECT action, outcome, count, detail, reason FROM operator_actions "
           "WHERE action = 'bulk.erase' ORDER BY id")  # fmt: skip
    return [dict(r) for r in env.query(sql)]


def test_an_erase_by_tenant_leaves_no_object_of_its_photos(env: Env) -> None:
    """Three photos of one tenant (one re-rendered: two generations) and one of another;
    the dry run counts three and changes nothing; `erase --tenant acme --original` leaves
    no object of the three and every object of the other; each is erased once (one event),
    the trail says started and done with the count and the objects deleted; a rerun of
    the same command selects nothing (they are erased)."""
    acme, other = ingest(env, "acme", SMALL), ingest(env, "other", SMALL[:1])
    env.cli("run", "--drain")
    env.cli("enqueue", "--rerender", str(acme[0]))
    env.cli("run", "--drain")
    objects = sum(len(stored(env, p)) for p in acme)
    kept = stored(env, other[0])
    dry = env.cli("erase", "--tenant", "acme", "--dry-run", *REASON)
    assert "would act on 3 photo(s)" in dry.stderr
    assert sum(len(stored(env, p)) for p in acme) == objects
    done = env.cli("erase", "--tenant", "acme", "--original", "--rate", "50/s", *REASON)
    assert "3 photo(s) selected" in done.stderr, done.stderr
    assert all(stored(env, p) == [] for p in acme)
    assert stored(env, other[0]) == kept and kept
    assert {r["photo_id"]: r["n"] for r in env.query(ERASED_EVENTS)} == dict.fromkeys(acme, 1)
    assert {row(env, p)["processing_state"] for p in acme} == {"erased"}
    assert row(env, other[0])["processing_state"] == "processed"
    dry_row, started, ended_row = trail(env)
    assert (dry_row["outcome"], dry_row["count"]) == ("dry_run", 3)
    assert (started["action"], started["outcome"], started["count"]) == ("bulk.erase", "started", 3)
    assert (ended_row["outcome"], ended_row["count"]) == ("done", 3)
    assert json.loads(ended_row["detail"]) == {"sent": 3, "objects_deleted": objects}
    again = env.cli("erase", "--tenant", "acme", *REASON)
    assert "0 photo(s) selected" in again.stderr


def test_the_id_form_and_the_usage_errors(file_env: Env) -> None:
    """`erase ID` still erases one photo; ids with filters, neither, `--state erased`,
    `--to-lane`, or a bulk erase without a reason exit 2 and change nothing."""
    photos = ingest(file_env, "acme", SMALL[:2])
    for args in (
        ("erase", str(photos[0]), "--tenant", "acme", *REASON),
        ("erase", *REASON),
        ("erase", "--state", "erased", *REASON),
        ("bulk", "erase", "--tenant", "acme", "--to-lane", "bulk", *REASON),
        ("bulk", "erase", "--tenant", "acme"),
        ("bulk", "retry", "--tenant", "acme", "--original"),
    ):
        assert file_env.cli(*args, check=False).returncode == 2, args
    assert file_env.query("SELECT 1 FROM operator_actions") == []
    file_env.cli("erase", str(photos[0]), *REASON)
    states = {p: row(file_env, p)["processing_state"] for p in photos}
    assert states == {photos[0]: "erased", photos[1]: "uploaded"}


def test_resuming_a_finished_erase_acts_on_its_own_photos_only(file_env: Env) -> None:
    """`--resume ACTION_ID` of a bulk erase that ended continues that action's frozen
    items: a photo of the tenant uploaded since is not erased (a resume used to freeze the
    selection again under the old id once the action had ended or was a day old)."""
    first = ingest(file_env, "acme", SMALL[:2])
    file_env.cli("bulk", "erase", "--tenant", "acme", *REASON)
    [started] = file_env.query("SELECT action_id FROM operator_actions WHERE outcome = 'started'")
    [later] = ingest(file_env, "acme", SMALL[2:])
    again = file_env.cli("bulk", "erase", "--resume", str(started["action_id"]), *REASON)
    assert "2 photo(s) selected (resumed)" in again.stderr, again.stderr
    assert {row(file_env, p)["processing_state"] for p in first} == {"erased"}
    assert row(file_env, later)["processing_state"] == "uploaded"
    items = file_env.query("SELECT photo_id FROM bulk_action_items WHERE action_id = $1",
                           started["action_id"])  # fmt: skip
    assert sorted(r["photo_id"] for r in items) == sorted(first)


SEED_SQL = """
INSERT INTO photos (id, original_key, tenant, processing_state, renditions, processed_at)
SELECT id, 'originals/' || id, $2, 'processed', '[]', now() FROM unnest($1::uuid[]) AS id
"""


def seed_with_objects(env: Env, tenant: str, n: int) -> list[uuid.UUID]:
    """`n` processed photos of `tenant`, each with two rendition files and its original
    in the local folder (rows and objects as a render leaves them, without rendering)."""
    photos = [uuid.uuid4() for _ in range(n)]
    root = env.tmp / "var" / "storage"
    for photo_id in photos:
        (root / "renditions" / str(photo_id)).mkdir(parents=True)
        for name in ("thumb-0a.webp", "large-0b.webp"):
            (root / "renditions" / str(photo_id) / name).write_bytes(b"x")
        (root / "originals").mkdir(exist_ok=True)
        (root / "originals" / str(photo_id)).write_bytes(b"original")
    env.query(SEED_SQL, photos, tenant)
    return photos


def items_done(env: Env) -> int:
    rows = env.query("SELECT count(*)::int AS n FROM bulk_action_items WHERE state <> 'pending'")
    return int(rows[0]["n"])


def test_a_bulk_erase_killed_mid_way_and_rerun_erases_each_photo_once(file_env: Env) -> None:
    """SIGKILL a paced `bulk erase` part-way, run the same command again: it resumes the
    same action; every selected photo is erased exactly once (one event each), no object
    of theirs is left, the other tenant's are all there, and the trail's count is exact."""
    acme, other = seed_with_objects(file_env, "acme", 60), seed_with_objects(file_env, "b", 3)
    args = ("bulk", "erase", "--tenant", "acme", "--original", *REASON)
    proc = file_env.start(*args, "--rate", "40/s")
    wait_until(lambda: items_done(file_env) >= 10)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert items_done(file_env) < 60, "the run ended before the kill: nothing was tested"
    result = file_env.cli(*args)
    assert "(resumed)" in result.stderr
    assert {r["photo_id"]: r["n"] for r in file_env.query(ERASED_EVENTS)} == dict.fromkeys(acme, 1)
    assert all(stored(file_env, p) == [] for p in acme)
    assert all(len(stored(file_env, p)) == 3 for p in other)
    states = file_env.query("SELECT state, count(*)::int AS n FROM bulk_action_items GROUP BY 1")
    assert [dict(r) for r in states] == [{"state": "sent", "n": 60}]
    outcomes = [(r["outcome"], r["count"]) for r in trail(file_env)]
    assert outcomes == [("started", 60), ("started", 60), ("done", 60)]


def test_s3_a_failed_delete_leaves_the_item_for_a_rerun(s3_env: Env) -> None:
    """Deletes denied: the rows are erased all the same (a render can no longer publish),
    the run exits 1 naming the keys, its items stay `acted` and the trail says
    `interrupted`; the same command run again deletes them: nothing is left, and no
    photo was erased twice."""
    photos = ingest(s3_env, "acme", SMALL[:2])
    s3_env.cli("run", "--drain")
    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    args = ("erase", "--tenant", "acme", *REASON)
    try:
        proxy.deny(lambda method, path: method == "DELETE" and PROBE not in path)
        failed = s3_env.cli(*args, check=False, DARKROOM_S3_ENDPOINT_URL=proxy.url)
    finally:
        proxy.close()
    assert failed.returncode == 1, failed.stderr
    assert "not deleted  renditions/" in failed.stderr and "run the same command" in failed.stderr
    assert {row(s3_env, p)["processing_state"] for p in photos} == {"erased"}
    assert all(stored(s3_env, p) for p in photos), "the objects are still there"
    s3_env.cli(*args)
    assert all(stored(s3_env, p) == [row(s3_env, p)["original_key"]] for p in photos)
    assert {r["photo_id"]: r["n"] for r in s3_env.query(ERASED_EVENTS)} == dict.fromkeys(photos, 1)
    outcomes = [(r["outcome"], r["count"]) for r in trail(s3_env)]
    assert outcomes == [("started", 2), ("interrupted", 2), ("started", 2), ("done", 2)]


def test_a_bulk_erase_during_a_render_wins_and_leaves_no_object(
    env: Env, stopped: list[int]
) -> None:
    """A worker stopped (SIGSTOP) while it renders the tenant's photo; the tenant is
    erased; the worker continues: its publish is refused, it deletes what it uploaded, and
    no rendition of the photo is left; it is never published."""
    [photo_id] = ingest(env, "acme", [PHOTO])
    worker = env.start("run")
    wait_for(lambda: env.query("SELECT 1 FROM photo_jobs WHERE photo_id = $1 AND "
                               "state = 'active'", photo_id), worker)  # fmt: skip
    os.kill(worker.pid, signal.SIGSTOP)
    stopped.append(worker.pid)
    time.sleep(0.3)  # a statement sent just before the stop commits all the same
    env.cli("erase", "--tenant", "acme", *REASON)  # the original stays: the render goes on
    os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: ended(env, photo_id), worker)
    assert ended(env, photo_id) == ["skipped"], "the refused publish settles the entry"
    assert stored(env, photo_id) == [row(env, photo_id)["original_key"]]
    types = env.query("SELECT type FROM photo_events WHERE photo_id = $1", photo_id)
    assert [e["type"] for e in types] == ["darkroom.photo.erased"], "never published"


def test_s3_a_bulk_erase_while_an_upload_is_stalled_leaves_no_object(s3_env: Env) -> None:
    """The worker's 3rd rendition upload stalls after two landed; `erase --tenant
    --original` commits and deletes what it lists; the stalled upload lands on its retry,
    after the listing: the refused publish deletes it, and nothing of the photo is left."""
    proxy = DenyingS3Proxy(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])
    try:
        uploads = itertools.count()
        proxy.hold(lambda method, path: method == "PUT" and "/renditions/" in path
                   and PROBE not in path and next(uploads) >= 2)  # fmt: skip
        [photo_id] = ingest(s3_env, "acme", [PHOTO])
        worker = s3_env.start("run", DARKROOM_S3_ENDPOINT_URL=proxy.url)
        wait_for(lambda: proxy.held > 0, worker)
        assert [k for k in stored(s3_env, photo_id) if k.startswith("renditions/")]
        s3_env.cli("erase", "--tenant", "acme", "--original", *REASON)
        assert stored(s3_env, photo_id) == []
        proxy.release()
        wait_for(lambda: ended(s3_env, photo_id), worker)
    finally:
        proxy.close()
    assert ended(s3_env, photo_id) == ["skipped"]
    assert stored(s3_env, photo_id) == []
