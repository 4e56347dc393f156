"""Every command-line operator action leaves its rows in the audit trail: who (the
DARKROOM_OPERATOR setting, else the login user), what, on which selection, how many and how
it ended; a long action stopped by a signal ends `interrupted` under its own action id."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import uuid
from typing import Any

import pytest

from tests.conftest import Env


def bad_photos(env: Env, n: int) -> list[uuid.UUID]:
    """`n` photos that fail (`unsupported_format`), each with its dead letter."""
    paths = []
    for i in range(n):
        path = env.tmp / f"bad-{i}.jpg"
        path.write_text("not a picture")
        paths.append(path)
    ids = env.ingest(paths)
    env.cli("run", "--drain")
    return ids


def trail(env: Env, action: str) -> list[dict[str, Any]]:
    """The rows of one action, oldest first, read back through `darkroom audit --json`."""
    rows = json.loads(env.cli("audit", "--json", "--action", action, "--limit", "500").stdout)
    return list(reversed(rows))


def ending(env: Env, action: str) -> dict[str, Any]:
    """The newest row of `action`, checked to be an ending."""
    row = trail(env, action)[-1]
    assert row["outcome"] != "started"
    return row


def test_dlq_replay_records_its_selection_count_and_operator(file_env: Env) -> None:
    """`dlq replay` writes `started` then `done` under one action id, with the codes, limit,
    rate, reason and how many went back; `--dry-run` ends `dry_run` and replays nothing."""
    bad_photos(file_env, 3)
    file_env.cli("dlq", "replay", "--dry-run", DARKROOM_OPERATOR="alice")
    assert ending(file_env, "dlq.replay")["outcome"] == "dry_run"
    assert ending(file_env, "dlq.replay")["count"] == 3
    assert file_env.redis.xlen(file_env.dead) == 3, "a dry run replays nothing"
    why = ["--reason", "format support shipped"]
    file_env.cli("dlq", "replay", "--code", "unsupported_format", "--limit", "2", "--rate",
                 "50/s", *why, DARKROOM_OPERATOR="alice")  # fmt: skip
    started, done = trail(file_env, "dlq.replay")[-2:]
    assert (started["outcome"], done["outcome"]) == ("started", "done")
    assert started["action_id"] == done["action_id"]
    assert done["selection"] == {"codes": ["unsupported_format"], "limit": 2, "rate_per_s": 50.0}
    assert (done["operator"], done["via"], done["count"]) == ("alice", "cli", 2)
    assert done["reason"] == "format support shipped"
    assert file_env.redis.xlen(file_env.dead) == 1


def test_without_darkroom_operator_the_login_user_is_recorded(file_env: Env) -> None:
    """With DARKROOM_OPERATOR unset, the row names the login user; set, it names it."""
    file_env.cli("consumers", "prune", "--dry-run")
    assert ending(file_env, "consumers.prune")["operator"] == getpass.getuser()
    file_env.cli("consumers", "prune", DARKROOM_OPERATOR="ops-bot")
    row = ending(file_env, "consumers.prune")
    assert (row["operator"], row["outcome"]) == ("ops-bot", "done")
    bad = file_env.cli("consumers", "prune", check=False, DARKROOM_OPERATOR=" ")
    assert bad.returncode == 2 and "DARKROOM_OPERATOR" in bad.stderr


def test_retry_and_enqueue_record_how_many_photos_went_back(file_env: Env) -> None:
    """`retry` of a failed photo ends `done` with count 1; of a photo that is not failed,
    `refused` with count 0; `enqueue` counts what it enqueued, with lane and tenant."""
    first, second = bad_photos(file_env, 2)
    file_env.cli("retry", str(first), DARKROOM_OPERATOR="bob")
    row = ending(file_env, "retry")
    assert (row["outcome"], row["count"], row["selection"]) == (
        "done", 1, {"photo_ids": [str(first)]})  # fmt: skip
    assert len(trail(file_env, "retry")) == 1, "a short action writes its ending alone"
    again = file_env.cli("retry", str(first), check=False, DARKROOM_OPERATOR="bob")
    assert again.returncode == 1
    row = ending(file_env, "retry")
    assert (row["outcome"], row["count"], row["detail"]) == (
        "refused", 0, {"left_alone": [str(first)]})  # fmt: skip
    file_env.cli("enqueue", str(first), "--lane", "bulk", "--tenant", "acme",
                 DARKROOM_OPERATOR="bob")  # fmt: skip
    row = ending(file_env, "enqueue")
    assert (row["outcome"], row["count"]) == ("done", 1)
    assert row["selection"] == {"photo_ids": [str(first)], "lane": "bulk", "tenant": "acme"}
    refused = file_env.cli("enqueue", str(second), "--lane", "bulk", check=False)
    assert refused.returncode == 1, "a failed photo is not handed to the feeder"
    row = ending(file_env, "enqueue")
    assert (row["count"], row["detail"]) == (0, {"not_fed": [str(second)]})


def test_rerender_and_gc_record_their_selection_and_count(file_env: Env) -> None:
    """`enqueue --rerender --state processed --since` and `gc` (and its dry run) each write
    `started` and one ending, with what they selected and how many they touched."""
    file_env.cli("enqueue", "--rerender", "--state", "processed", "--since", "2020-01-01",
                 DARKROOM_OPERATOR="carol")  # fmt: skip
    started, done = trail(file_env, "rerender")
    assert (started["outcome"], done["outcome"], done["count"]) == ("started", "done", 0)
    assert done["selection"]["state"] == "processed"
    assert done["selection"]["since"].startswith("2020-01-01")
    orphan = file_env.tmp / "var" / "storage" / "renditions" / str(uuid.uuid4()) / "x.webp"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"orphan")
    old_s = 1_000_000_000  # 2001: past any grace
    os.utime(orphan, (old_s, old_s))
    file_env.cli("gc", "--dry-run", DARKROOM_OPERATOR="carol")
    assert (ending(file_env, "gc")["outcome"], ending(file_env, "gc")["count"]) == ("dry_run", 1)
    assert orphan.exists()
    file_env.cli("gc", "--reason", "monthly", DARKROOM_OPERATOR="carol")
    rows = trail(file_env, "gc")
    assert [r["outcome"] for r in rows] == ["started", "dry_run", "started", "done"]
    assert rows[-1]["count"] == 1 and rows[-1]["detail"]["deleted"] == 1
    assert rows[-1]["reason"] == "monthly" and not orphan.exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_paced_replay_stopped_by_a_signal_ends_interrupted(file_env: Env, signum: int) -> None:
    """`dlq replay --rate` stopped by Ctrl-C or SIGTERM exits 130 and leaves `started` and
    `interrupted` under one action id, counting the letters it replayed before the signal
    (not the ones it never reached)."""
    bad_photos(file_env, 2)
    for _ in range(40):  # letters after the two real ones: the replay is still pacing
        file_env.redis.xadd(file_env.dead, {"photo_id": str(uuid.uuid4()), "error_code": "x"})
    proc = file_env.start("dlq", "replay", "--rate", "4/s", DARKROOM_OPERATOR="dana")
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    assert sum("replayed as" in line for line in lines) == 2, lines
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 130, err
    started, ended = trail(file_env, "dlq.replay")
    assert (started["outcome"], ended["outcome"]) == ("started", "interrupted")
    assert started["action_id"] == ended["action_id"] and ended["operator"] == "dana"
    assert ended["count"] == 2 and ended["detail"]["skipped"] < 40
