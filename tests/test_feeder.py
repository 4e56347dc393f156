"""The feeder against real PostgreSQL and Redis: the PostgreSQL-only producer, the catch-up
scan, a producer that also XADDs, fair bulk feeding, a feeder's takeover, the switch off."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from tests.conftest import PHOTOS, Env

SMALL = PHOTOS / "4.webp"
# The feeder's duty held: a live lease in this test's own database.
FEEDER_LOCK = "SELECT 1 FROM darkroom_duties WHERE name = 'feeder' AND expires_at > now()"


def store_original(env: Env) -> tuple[uuid.UUID, str]:
    photo_id = uuid.uuid4()
    key = f"originals/{photo_id}/{SMALL.name}"
    path = env.tmp / "var" / "storage" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SMALL, path)
    return photo_id, key


def insert_row(env: Env, **columns: Any) -> uuid.UUID:
    """What a PostgreSQL-only producer does: the original stored, one INSERT, nothing else."""
    photo_id, key = store_original(env)
    names = ["id", "original_key", *columns]
    marks = ", ".join(f"${i + 1}" for i in range(len(names)))
    env.query(f"INSERT INTO photos ({', '.join(names)}) VALUES ({marks})",
              photo_id, key, *columns.values())  # fmt: skip
    return photo_id


def wait_for(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def processed(env: Env, ids: list[uuid.UUID]) -> bool:
    rows = env.query("SELECT processing_state FROM photos WHERE id = ANY($1::uuid[])", ids)
    return [r["processing_state"] for r in rows] == ["processed"] * len(ids)


def start_feeding(env: Env, **extra: str) -> None:
    env.start("run", **extra)
    wait_for(lambda: bool(env.query(FEEDER_LOCK)))


def published_per_photo(env: Env) -> Counter[str]:
    """From the workers' logs: how many entries of each photo ended `published`."""
    counts: Counter[str] = Counter()
    for proc in env.procs:
        proc.kill()
        for line in proc.communicate()[1].splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "entry done" and record.get("outcome") == "published":
                counts[record["photo_id"]] += 1
    return counts


def assert_started_without_the_scans(env: Env, ids: list[uuid.UUID]) -> None:
    """Commit to claim: the median within 1.5 s, none past 3 s. They rule out the 2 s
    catch-up and the 30 s scan, not a slow turn (bench/intake.py has the figures: 0.5 s)."""
    rows = env.query(
        "SELECT extract(epoch FROM j.started_at - p.created_at) AS wait_s"
        " FROM photos p JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = ANY($1::uuid[])",
        ids,
    )
    waits = sorted(float(r["wait_s"]) for r in rows)
    assert len(waits) == len(ids) and waits[len(ids) // 2] < 1.5 and waits[-1] < 3.0, waits


def test_a_postgresql_only_row_starts_rendering_within_a_second(file_env: Env) -> None:
    """Rows inserted one by one without any XADD are claimed within 1 s of their commit
    (the median; bench/intake.py has the figures, 0.5 s) and processed; none meets its own
    job row half-made and waits as `busy` or for the 2 s catch-up scan. The bounds leave a
    loaded machine room: they rule out the scans, not a slow turn."""
    start_feeding(file_env)
    ids = []
    for _ in range(6):
        ids.append(insert_row(file_env))
        time.sleep(0.3)
    wait_for(lambda: processed(file_env, ids))
    assert_started_without_the_scans(file_env, ids)


def test_a_postgresql_only_row_starts_within_a_second_while_events_stream(file_env: Env) -> None:
    """On a busy database (an outcome's notice every 20 ms, which the feeder's listener is
    signalled with too and then reads in turns), rows inserted without any XADD are still
    claimed within about a second of their commit."""
    start_feeding(file_env)
    stop = threading.Event()

    async def notices() -> None:
        conn = await asyncpg.connect(file_env.database_url)
        try:
            while not stop.wait(0.02):
                await conn.execute("SELECT pg_notify('darkroom_events', '{}')")
        finally:
            await conn.close()

    busy = threading.Thread(target=lambda: asyncio.run(notices()))
    busy.start()
    try:
        time.sleep(0.5)  # the listener has seen a busy turn
        ids = []
        for _ in range(6):
            ids.append(insert_row(file_env))
            time.sleep(0.3)
        wait_for(lambda: processed(file_env, ids))
    finally:
        stop.set()
        busy.join()
    assert_started_without_the_scans(file_env, ids)


def test_rows_inserted_while_no_worker_ran_are_caught_up(file_env: Env) -> None:
    """Notifications nobody heard are not needed: the catch-up scan finds the rows."""
    ids = [insert_row(file_env) for _ in range(3)]
    start_feeding(file_env)
    wait_for(lambda: processed(file_env, ids))


def test_a_producer_that_inserts_and_xadds_gets_one_render(file_env: Env) -> None:
    """Old producers XADD too and leave enqueued_at NULL: every photo is rendered once,
    even with one render slot and a backlog longer than the intake's grace."""
    start_feeding(file_env, DARKROOM_CONCURRENCY="1", DARKROOM_CLAIM_IDLE_MS="1500")
    ids = []
    for _ in range(8):
        ids.append(insert_row(file_env))
        file_env.redis.xadd(file_env.stream, {"photo_id": str(ids[-1])})
    wait_for(lambda: processed(file_env, ids), 60)
    time.sleep(2)  # duplicates, if any, come back after CLAIM_IDLE_MS and finish as `already`
    assert published_per_photo(file_env) == {str(i): 1 for i in ids}
    attempts = file_env.query(
        "SELECT attempt FROM photo_jobs WHERE photo_id = ANY($1::uuid[])", ids
    )
    assert [a["attempt"] for a in attempts] == [1] * len(ids)


def test_bulk_photos_are_fed_in_fair_order_by_cost(file_env: Env) -> None:
    """Two tenants, one with 4x larger photos: the first 15 photos fed (in entry order, as
    PostgreSQL records each XADD; the worker renders them meanwhile) hold equal pixels of
    each, so four small photos per large one."""
    for _ in range(20):
        insert_row(file_env, lane="bulk", tenant="large", cost=24_000_000)
        insert_row(file_env, lane="bulk", tenant="small", cost=6_000_000)
    start_feeding(file_env, DARKROOM_BULK_AHEAD="15")
    wait_for(lambda: len(fed_in_order(file_env)) >= 15)
    first = fed_in_order(file_env)[:15]
    assert Counter(first) == {"large": 3, "small": 12}


def fed_in_order(env: Env) -> list[str]:
    """The tenants of the bulk photos fed so far, in the order of their entries' ids."""
    rows = env.query("SELECT p.tenant, j.stream_entry FROM photos p JOIN photo_jobs j"
                     " ON j.photo_id = p.id WHERE p.lane = 'bulk'"
                     " AND p.enqueued_at IS NOT NULL AND j.stream_entry IS NOT NULL")  # fmt: skip
    rows.sort(key=lambda r: tuple(int(n) for n in r["stream_entry"].split("-")))
    return [r["tenant"] for r in rows]


def ingest_bulk_and_time_its_feeding(env: Env, tenant: str) -> float:
    """One bulk photo of `tenant` ingested and processed: seconds from its insert to its feed."""
    [line] = env.cli("ingest", "--lane", "bulk", "--tenant", tenant, str(SMALL)).stdout.split()
    photo_id = uuid.UUID(line)
    wait_for(lambda: processed(env, [photo_id]))
    [row] = env.query("SELECT extract(epoch FROM enqueued_at - created_at)::float8 AS s"
                      " FROM photos WHERE id = $1", photo_id)  # fmt: skip
    return float(row["s"])


def test_a_bulk_ingest_is_fed_within_a_second_woken_by_the_insert_trigger(file_env: Env) -> None:
    """`ingest --lane bulk` sends no NOTIFY of its own: the insert's trigger wakes the
    feeder, which feeds the photo after its grace, long before its next tenant scan."""
    start_feeding(file_env)
    time.sleep(0.5)  # past the feeder's first tenant scan
    fed_s = ingest_bulk_and_time_its_feeding(file_env, "t")
    assert fed_s < 5.0, f"fed {fed_s:.2f} s after its insert: by the 30 s tenant scan"


def test_a_listener_the_server_closed_is_noticed_and_replaced(file_env: Env) -> None:
    """The feeder's listener killed while idle (an operator's pg_terminate_backend): the
    feeder notices, listens afresh, and a new tenant's insert is heard, not left to the
    30 s tenant scan."""
    start_feeding(file_env)
    wait_for(lambda: bool(file_env.query(FEEDER_LOCK)))
    time.sleep(0.5)  # past the feeder's first tenant scan
    killed = file_env.query(
        "SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity"
        " WHERE datname = current_database() AND query LIKE 'LISTEN%'"
    )
    assert killed, "no listener to kill"
    time.sleep(1.0)
    fed_s = ingest_bulk_and_time_its_feeding(file_env, "new")
    assert fed_s < 10.0, f"fed {fed_s:.2f} s after its insert: by the 30 s tenant scan"


TENANT_CHECK = "photos_tenant_length_check"


def test_a_tenant_over_128_characters_fails_the_producer_s_insert(file_env: Env) -> None:
    """The database refuses a 129-character tenant with check_violation naming the
    constraint (the producer learns at its INSERT); 128 characters are fine."""
    insert_row(file_env, lane="bulk", tenant="t" * 128)
    with pytest.raises(asyncpg.CheckViolationError, match=TENANT_CHECK):
        insert_row(file_env, lane="bulk", tenant="t" * 129)


def test_rows_with_over_long_tenants_from_before_the_constraint_are_rendered(file_env: Env) -> None:
    """A tenant of 1,200 bytes in rows inserted while the database had no constraint: the
    feeder's entry names its first 128 characters and the photo is rendered, not
    dead-lettered; the upgrade that adds the constraint does not fail on such a row, cuts
    its tenant to 128 characters, and the photo is rendered too."""
    file_env.query(f"ALTER TABLE photos DROP CONSTRAINT {TENANT_CHECK}")
    long = "ü" * 600  # 1,200 bytes of UTF-8: past a stream field's 1,024
    before = insert_row(file_env, lane="bulk", tenant=long)
    file_env.cli("run", "--drain", timeout=60)
    assert processed(file_env, [before]) and file_env.redis.xlen(file_env.dead) == 0
    upgraded = insert_row(file_env, lane="bulk", tenant=long)
    file_env.query("DELETE FROM darkroom_schema")  # an older schema: migrate applies this one
    file_env.cli("migrate")
    rows = file_env.query("SELECT id, tenant FROM photos WHERE id = ANY($1::uuid[])",
                          [before, upgraded])  # fmt: skip
    assert {r["tenant"] for r in rows} == {"ü" * 128}
    file_env.cli("run", "--drain", timeout=60)
    assert processed(file_env, [upgraded]) and file_env.redis.xlen(file_env.dead) == 0


def test_a_dead_feeder_is_replaced(file_env: Env) -> None:
    """Kill the worker that feeds: another takes the duty once its lease runs out and
    enqueues new rows."""
    lease = {"DARKROOM_DUTY_LEASE_S": "2"}  # the killed holder never releases it
    start_feeding(file_env, **lease)
    first = file_env.procs[0]
    file_env.start("run", **lease)
    first.kill()
    first.communicate()
    photo_id = insert_row(file_env)
    wait_for(lambda: processed(file_env, [photo_id]))
    assert file_env.query(FEEDER_LOCK)


def test_pg_intake_off_leaves_interactive_rows_but_feeds_bulk(file_env: Env) -> None:
    """DARKROOM_PG_INTAKE=false: an interactive row waits for its producer's XADD; a bulk
    row is fed all the same (the feeder is the only way into the bulk stream)."""
    start_feeding(file_env, DARKROOM_PG_INTAKE="false")
    interactive = insert_row(file_env)
    bulk = insert_row(file_env, lane="bulk", tenant="t")
    wait_for(lambda: processed(file_env, [bulk]))
    time.sleep(1.5)
    [row] = file_env.query("SELECT processing_state, enqueued_at FROM photos WHERE id = $1",
                           interactive)  # fmt: skip
    assert row == {"processing_state": "uploaded", "enqueued_at": None}
    assert file_env.redis.xlen(file_env.stream) == 0


def test_a_stopped_worker_gives_the_feeder_duty_up(file_env: Env) -> None:
    """SIGTERM: the worker exits promptly, and its feeder's lease is ended for the next one
    (not left to run out)."""
    start_feeding(file_env)
    proc = file_env.procs[0]
    proc.terminate()
    assert proc.wait(20) == 0
    assert not file_env.query(FEEDER_LOCK)
