"""The operator's audit trail: rows are inserted, read back newest first, and never
updated in place."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest

from darkroom.store import audit, db
from tests.conftest import Env


async def test_an_action_is_recorded_and_read_back_newest_first(database_url: str) -> None:
    """Two actions come back newest first, with their selection, count and reason."""
    pool = await db.connect(database_url, 2)
    try:
        first = audit.Action(operator="alice", via="cli", action="pause",
                             selection={"lane": "bulk"}, reason="incident 7")  # fmt: skip
        await audit.record(pool, first, "done", count=0)
        second = audit.Action(operator="bob", via="page", action="dlq.replay")
        await audit.record(pool, second, "started")
        rows = await audit.since(pool, None, 10)
    finally:
        await pool.close()
    assert [r["operator"] for r in rows] == ["bob", "alice"]
    assert rows[1]["selection"] == {"lane": "bulk"} and rows[1]["reason"] == "incident 7"
    assert rows[1]["count"] == 0 and rows[0]["outcome"] == "started"


async def test_a_row_cannot_be_rewritten(database_url: str) -> None:
    """An UPDATE of a recorded row is refused by the database itself."""
    pool = await db.connect(database_url, 1)
    try:
        await audit.record(pool, audit.Action(operator="a", via="cli", action="gc"), "done")
        with pytest.raises(asyncpg.RestrictViolationError, match="never updated"):
            await pool.execute("UPDATE operator_actions SET outcome = 'failed'")
    finally:
        await pool.close()


def test_the_command_prints_the_trail_as_json(file_env: Env) -> None:
    """`darkroom audit --json` lists what was recorded, newest first."""

    async def seed() -> None:
        pool = await db.connect(file_env.database_url, 1)
        try:
            action = audit.Action(operator="carol", via="cli", action="gc", reason="cleanup")
            await audit.record(pool, action, "done", count=3)
        finally:
            await pool.close()

    asyncio.run(seed())
    rows = json.loads(file_env.cli("audit", "--json").stdout)
    assert rows[0]["operator"] == "carol" and rows[0]["count"] == 3
    assert "carol  cli  gc  done  3" in file_env.cli("audit").stdout
