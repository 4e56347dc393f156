"""Bulk actions by query against real PostgreSQL and Redis: the selection's exact count,
a dry run that changes nothing, the rate, a run SIGKILLed mid-way and rerun (each photo
acted on once), and a move the feeder honours."""

from __future__ import annotations

import asyncio
import io
import itertools
import signal
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from darkroom.operate import bulk
from darkroom.operate.progress import Progress
from darkroom.store import audit, db, selection
from darkroom.store.selection import Selection
from tests.conftest import Env
from tests.test_feeder import insert_row, processed, wait_for

T0 = datetime(2026, 11, 1, tzinfo=UTC)
TENANTS = ("acme", "globex", "")
STATES = ("uploaded", "processed", "processing_failed")
CODES = ("render_timeout", "decode_failed")
FORMATS = ("jpeg", "heic")

INSERT_SQL = """
INSERT INTO photos (id, original_key, tenant, processing_state, error_code, lane, format,
                    created_at, processed_at, renditions, enqueued_at)
VALUES ($1, 'originals/x', $2, $3, $4, $5, $6, $7, $8, $9, $7)
"""
JOB_SQL = "INSERT INTO photo_jobs (photo_id, state, attempt) VALUES ($1, 'failed', 1)"


def mixed_rows() -> list[dict[str, Any]]:
    """Every combination of tenant, state, code, lane and format, over ten days."""
    rows = []
    combos = itertools.product(TENANTS, STATES, CODES, ("interactive", "bulk"), FORMATS)
    for i, (tenant, state, code, lane, fmt) in enumerate(combos):
        created = T0 + timedelta(hours=5 * i)
        rows.append({"id": uuid.uuid4(), "tenant": tenant, "state": state, "lane": lane,
                     "code": code if state == "processing_failed" else None, "format": fmt,
                     "created": created, "processed": processed_at(state, created)})  # fmt: skip
    return rows


def processed_at(state: str, created: datetime) -> datetime | None:
    return created + timedelta(hours=1) if state == "processed" else None


async def seed(pool: db.Pool, rows: list[dict[str, Any]]) -> None:
    await pool.executemany(INSERT_SQL, [
        (r["id"], r["tenant"], r["state"], r["code"], r["lane"], r["format"], r["created"],
         r["processed"], "[]" if r["state"] == "processed" else None) for r in rows])  # fmt: skip
    failed = [(r["id"],) for r in rows if r["state"] == "processing_failed"]
    await pool.executemany(JOB_SQL, failed)


def seed_sync(env: Env, rows: list[dict[str, Any]]) -> None:
    async def go() -> None:
        pool = await db.connect(env.database_url, 1)
        try:
            await seed(pool, rows)
        finally:
            await pool.close()

    asyncio.run(go())


def matches(row: dict[str, Any], where: Selection) -> bool:
    """The selection's meaning, in Python: what the SQL must count."""
    checks = [
        where.tenant in (None, row["tenant"]), where.state in (None, row["state"]),
        where.code in (None, row["code"]), where.lane in (None, row["lane"]),
        where.format in (None, row["format"]),
        where.created_since is None or row["created"] >= where.created_since,
        where.created_until is None or row["created"] < where.created_until,
        where.processed_since is None or ((row["processed"] or T0) >= where.processed_since
        and row["processed"] is not None),
    ]  # fmt: skip
    return all(checks)


SELECTIONS = [
    Selection(tenant="acme"),
    Selection(tenant="acme", state="processing_failed", code="render_timeout"),
    Selection(code="decode_failed", lane="bulk", format="heic"),
    Selection(
        tenant="", created_since=T0 + timedelta(days=2), created_until=T0 + timedelta(days=5)
    ),
    Selection(processed_since=T0 + timedelta(days=3), format="jpeg"),
    Selection(state="uploaded", lane="interactive"),
]


async def test_the_count_is_exact_over_mixed_tenants_states_and_codes(database_url: str) -> None:
    """Each selection counts exactly the seeded photos it matches, and samples only them."""
    rows = mixed_rows()
    pool = await db.connect(database_url, 2)
    try:
        await seed(pool, rows)
        for where in SELECTIONS:
            expected = {r["id"] for r in rows if matches(r, where)}
            assert await selection.count(pool, where) == len(expected), where
            assert set(await selection.sample(pool, where, 5)) <= expected
    finally:
        await pool.close()


def test_select_prints_the_count_and_a_sample(file_env: Env) -> None:
    """`darkroom select --count --sample 3` prints three matching ids and the exact count."""
    rows = mixed_rows()
    seed_sync(file_env, rows)
    out = file_env.cli("select", "--tenant", "acme", "--code", "render_timeout", "--count",
                       "--sample", "3").stdout.split()  # fmt: skip
    expected = {
        str(r["id"]) for r in rows if r["tenant"] == "acme" and r["code"] == "render_timeout"
    }
    assert int(out[-1]) == len(expected) and set(out[:-1]) <= expected and len(out) == 4


def test_a_dry_run_changes_nothing_and_is_audited(file_env: Env) -> None:
    """`bulk retry --dry-run` leaves every photo failed, freezes nothing, and records
    `dry_run` with the exact count."""
    rows = mixed_rows()
    seed_sync(file_env, rows)
    result = file_env.cli("bulk", "retry", "--tenant", "globex", "--dry-run", "--reason", "try")
    n = sum(r["tenant"] == "globex" and r["state"] == "processing_failed" for r in rows)
    assert f"would act on {n} photo(s)" in result.stderr
    failed = file_env.query(
        "SELECT count(*) AS n FROM photos WHERE processing_state = 'processing_failed'"
    )
    assert failed[0]["n"] == sum(r["state"] == "processing_failed" for r in rows)
    assert file_env.query("SELECT count(*) AS n FROM bulk_action_items")[0]["n"] == 0
    [row] = file_env.query("SELECT outcome, count, reason FROM operator_actions")
    assert dict(row) == {"outcome": "dry_run", "count": n, "reason": "try"}


def test_a_usage_error_acts_on_nothing(file_env: Env) -> None:
    """A bulk action without a selection, or retry of processed photos, exits 2."""
    assert file_env.cli("bulk", "retry", check=False).returncode == 2
    result = file_env.cli("bulk", "retry", "--state", "processed", "--tenant", "a", check=False)
    assert result.returncode == 2 and "processing_failed" in result.stderr


async def test_the_rate_is_honoured(database_url: str) -> None:
    """30 photos at 30/s take at least 0.8 s between the first act and the last (uncapped
    they take a few ms); the acts' own commit times say so."""
    rows = processed_rows(30, "paced")
    pool = await db.connect(database_url, 2)
    try:
        await seed(pool, rows)
        action = audit.Action(operator="t", via="cli", action="bulk.move")
        plan = bulk.Plan("move", Selection(tenant="paced"), to_tenant="moved")
        run = bulk.Run(action, plan, rate_per_s=30.0)
        total, _ = await bulk.begin(pool, run)
        assert total == 30
        # a move hands nothing to a stream: no Redis client is needed
        progress = Progress(total, "moved", io.StringIO())
        assert await bulk.execute(pool, None, run, progress)  # type: ignore[arg-type]
        [span] = await pool.fetch("SELECT extract(epoch FROM max(acted_at) - min(acted_at))::float8"
                                  " AS s FROM bulk_action_items")  # fmt: skip
    finally:
        await pool.close()
    assert span["s"] >= 0.8, span


def processed_rows(n: int, tenant: str) -> list[dict[str, Any]]:
    return [{"id": uuid.uuid4(), "tenant": tenant, "state": "processed", "code": None,
             "lane": "interactive", "format": "jpeg", "created": T0 + timedelta(minutes=i),
             "processed": T0 + timedelta(hours=1)} for i in range(n)]  # fmt: skip


def acted(env: Env) -> int:
    return int(
        env.query("SELECT count(*) AS n FROM bulk_action_items WHERE state <> 'pending'")[0]["n"]
    )


def test_a_run_killed_mid_way_and_rerun_acts_on_each_photo_once(file_env: Env) -> None:
    """SIGKILL a paced `bulk rerender` part-way, run the same command again: it resumes
    the same action, and every selected photo got exactly one re-render request (its
    generation is 1), none of another tenant any."""
    rows = processed_rows(60, "acme") + processed_rows(5, "other")
    seed_sync(file_env, rows)
    args = ("bulk", "rerender", "--tenant", "acme", "--reason", "new sizes")
    proc = file_env.start(*args, "--rate", "40/s")
    wait_for(lambda: acted(file_env) >= 10)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert acted(file_env) < 60, "the run ended before the kill: nothing was tested"
    result = file_env.cli(*args)
    assert "(resumed)" in result.stderr
    generations = file_env.query("SELECT tenant, rerender_generation AS g FROM photos")
    assert sorted({(r["tenant"], r["g"]) for r in generations}) == [("acme", 1), ("other", 0)]
    states = file_env.query("SELECT state, count(*) AS n FROM bulk_action_items GROUP BY 1")
    assert [dict(r) for r in states] == [{"state": "sent", "n": 60}]
    trail = file_env.query("SELECT outcome, count, detail FROM operator_actions ORDER BY id")
    assert [(r["outcome"], r["count"]) for r in trail] == [
        ("started", 60),
        ("started", 60),
        ("done", 60),
    ]
    assert (
        len({r["action_id"] for r in file_env.query("SELECT action_id FROM operator_actions")}) == 1
    )


def test_an_interrupted_retry_resumes_by_its_action_id(file_env: Env) -> None:
    """SIGINT stops a paced `bulk retry` with an `interrupted` row (exit 130); `--resume
    ACTION_ID` finishes it; every failed photo of the code was reset once (its job's new
    run starts at its one attempt) and sent to its stream."""
    rows = [r for r in mixed_rows() if r["code"] == "render_timeout"]
    seed_sync(file_env, rows)
    proc = file_env.start("bulk", "retry", "--code", "render_timeout", "--rate", "20/s")
    wait_for(lambda: acted(file_env) >= 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    [started] = file_env.query("SELECT action_id FROM operator_actions WHERE outcome = 'started'")
    file_env.cli("bulk", "retry", "--resume", str(started["action_id"]))
    outcomes = [
        r["outcome"] for r in file_env.query("SELECT outcome FROM operator_actions ORDER BY id")
    ]
    assert outcomes == ["started", "interrupted", "started", "done"]
    jobs = file_env.query("SELECT p.processing_state, j.run_offset, j.state FROM photos p"
                          " JOIN photo_jobs j ON j.photo_id = p.id")  # fmt: skip
    assert {(r["processing_state"], r["run_offset"], r["state"]) for r in jobs} == {
        ("uploaded", 1, "pending")
    }
    interactive = sum(r["lane"] == "interactive" for r in rows)
    assert file_env.redis.xlen(file_env.stream) == interactive


def test_a_move_changes_lane_and_tenant_and_the_feeder_honours_it(file_env: Env) -> None:
    """Bulk photos moved to another tenant are fed under it; bulk photos moved to the
    interactive lane go through the interactive stream; all are rendered."""
    retenant = [insert_row(file_env, lane="bulk", tenant="old") for _ in range(3)]
    relane = [insert_row(file_env, lane="bulk", tenant="x") for _ in range(2)]
    file_env.cli("bulk", "move", "--tenant", "old", "--to-tenant", "acme")
    file_env.cli("bulk", "move", "--tenant", "x", "--to-lane", "interactive")
    file_env.start("run")
    wait_for(lambda: processed(file_env, retenant + relane))
    # what each delivery went through (the attempt history) and what the publish told (events)
    attempts = file_env.query(
        "SELECT photo_id, lane FROM photo_attempts WHERE outcome = 'published'"
    )
    went = {r["photo_id"]: r["lane"] for r in attempts}
    assert [went[p] for p in retenant + relane] == ["bulk"] * 3 + ["interactive"] * 2
    events = file_env.query("SELECT data->>'tenant' AS tenant, data->>'lane' AS lane, count(*) AS n"
                            " FROM photo_events GROUP BY 1, 2 ORDER BY 1")  # fmt: skip
    assert [tuple(r.values()) for r in events] == [("acme", "bulk", 3), ("x", "interactive", 2)]


@pytest.mark.parametrize("verb", ["retry", "rerender"])
def test_the_old_id_forms_still_work(file_env: Env, verb: str) -> None:
    """`retry ID` and `enqueue --rerender --state processed --since` keep working beside
    the bulk forms."""
    rows = [r for r in mixed_rows() if r["tenant"] == "acme" and r["lane"] == "interactive"]
    seed_sync(file_env, rows)
    if verb == "retry":
        photo = next(r["id"] for r in rows if r["state"] == "processing_failed")
        assert str(photo) in file_env.cli("retry", str(photo)).stdout
        return
    file_env.cli("enqueue", "--rerender", "--state", "processed", "--since", "2026-10-01")
    marked = file_env.query("SELECT count(*) AS n FROM photos WHERE rerender_generation = 1")
    assert marked[0]["n"] == sum(r["state"] == "processed" for r in rows)
    assert file_env.query("SELECT count(*) AS n FROM bulk_action_items")[0]["n"] == 0
