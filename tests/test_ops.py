"""Operator command-line gaps: `dlq list --json`, `dlq replay --rate` with its progress,
`ingest` progress, consumers leaving the group and `consumers prune`; and the alert rules."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client import REGISTRY

from darkroom import metrics
from darkroom.operate import chart, ops
from darkroom.operate.progress import Pacer, Progress, parse_rate
from darkroom.operate.web.auth import Auth
from darkroom.queue.streams import Streams
from tests.conftest import PHOTOS, REDIS_URL, Env, free_port

ROOT = Path(__file__).parents[1]
ALERTS = ROOT / "deploy" / "prometheus"


def bad_photos(env: Env, n: int) -> list[str]:
    paths = []
    for i in range(n):
        path = env.tmp / f"bad-{i}.jpg"
        path.write_text("not a picture")
        paths.append(path)
    return [str(i) for i in env.ingest(paths)]


def test_dlq_list_json_gives_every_letter_with_its_fields(file_env: Env) -> None:
    """`dlq list --json` prints one JSON array of letters with id, photo and code."""
    ids = bad_photos(file_env, 2)
    file_env.cli("run", "--drain")
    letters = json.loads(file_env.cli("dlq", "list", "--json").stdout)
    assert sorted(letter["photo_id"] for letter in letters) == sorted(ids)
    assert {letter["error_code"] for letter in letters} == {"unsupported_format"}
    assert all(re.fullmatch(r"\d+-\d+", letter["id"]) for letter in letters)
    none = json.loads(file_env.cli("dlq", "list", "--json", "--code", "timeout").stdout)
    assert none == []


def test_dlq_replay_with_a_rate_prints_a_summary_line_off_a_terminal(file_env: Env) -> None:
    """`dlq replay --rate N/s` replays every letter, one result line each on stdout and one
    summary line on stderr when not on a terminal (no bar drawn into a pipe)."""
    bad_photos(file_env, 3)
    file_env.cli("run", "--drain")
    result = file_env.cli("dlq", "replay", "--rate", "20/s")
    assert result.stdout.count("replayed as") == 3
    assert re.fullmatch(r"replayed 3 of 3 in [\d.]+ s \([\d.]+/s\)\n", result.stderr)
    assert "\r" not in result.stderr and "#" not in result.stderr
    assert file_env.redis.xlen(file_env.dead) == 0 and file_env.redis.xlen(file_env.stream) == 3
    bad = file_env.cli("dlq", "replay", "--rate", "fast", check=False)
    assert bad.returncode == 2 and "rate must look like" in bad.stderr


def test_ingest_prints_ids_and_a_summary_line(file_env: Env) -> None:
    """`ingest` of many files: one id per line on stdout, one summary line on stderr."""
    result = file_env.cli("ingest", str(PHOTOS / "4.webp"), str(PHOTOS / "Landscape_1.jpg"))
    assert len(result.stdout.split()) == 2
    assert result.stderr.startswith("ingested 2 of 2 in ")


def test_progress_draws_a_bar_on_a_terminal() -> None:
    """On a terminal the bar is redrawn in place, result lines stay above it, and the
    summary closes it."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    err, out = Terminal(), io.StringIO()
    progress = Progress(4, "replayed", err)
    for i in range(4):
        progress.advance()
        progress.line(f"letter {i}", out)
    progress.finish()
    assert "\r[" in err.getvalue() and "] 4/4 " in err.getvalue()
    assert "#" * 30 in err.getvalue() and "replayed 4 of 4 in" in err.getvalue()
    assert out.getvalue().splitlines() == [f"letter {i}" for i in range(4)]


def test_rates_parse() -> None:
    """`50/s`, `600/m` and `7` parse; anything else is refused with the expected form."""
    assert (parse_rate("50/s"), parse_rate("600/m"), parse_rate("7")) == (50.0, 10.0, 7.0)
    for bad in ("0/s", "-1", "fast", "5/h"):
        with pytest.raises(ValueError, match="rate must look like"):
            parse_rate(bad)


async def test_the_pacer_spaces_calls() -> None:
    """11 paced calls at 100/s take at least 0.1 s (a lower bound only)."""
    pacer, started = Pacer(100), time.monotonic()
    for _ in range(11):
        await pacer.wait()
    assert time.monotonic() - started >= 0.099


def test_the_pacer_makes_up_the_time_its_caller_spends_acting() -> None:
    """Five waits then 40 ms of work, at 100/s: the 100th call comes at 0.99 s, as the
    rate says (spacing restarted after each act put it at 1.56 s), and after a 5 s stall
    at most catch_up_s of the rate comes at once."""
    pacer, now = Pacer(100, catch_up_s=0.1), 0.0
    pacer._next = 0.0
    for call in range(100):
        now += pacer.delay(now)
        if call == 99:
            assert now == pytest.approx(0.99, abs=1e-9)
        if call % 5 == 4:
            now += 0.040
    now += 5.0
    at_once = sum(pacer.delay(now) == 0 for _ in range(50))
    assert at_once == 11  # the 0.1 s made up (10 calls) and the call due now


def consumers(env: Env) -> dict[str, int]:
    try:
        rows: list[dict[str, Any]] = env.redis.xinfo_consumers(env.stream, "darkroom")
    except Exception:
        return {}
    return {row["name"]: int(row["pending"]) for row in rows}


def test_a_worker_that_exits_cleanly_leaves_the_group(file_env: Env) -> None:
    """`run --drain` removes its consumer from the group on a clean exit."""
    file_env.ingest([PHOTOS / "4.webp"])
    file_env.cli("run", "--drain", DARKROOM_CONSUMER="leaving-worker")
    assert file_env.redis.xlen(file_env.stream) == 0
    assert "leaving-worker" not in consumers(file_env)


async def test_a_consumer_holding_entries_is_never_removed(file_env: Env) -> None:
    """The remove-if-idle script keeps a consumer that has pending entries (deleting it
    would discard them) and removes one with none."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        streams = Streams(client, file_env.stream, "darkroom", "holder", file_env.dead)
        await streams.ensure_group()
        await streams.enqueue({"photo_id": "x"})
        assert len(await streams.read_new(1, 100)) == 1
        assert await streams.remove_self_if_idle() is False
        idle = Streams(client, file_env.stream, "darkroom", "idle", file_env.dead)
        await client.xgroup_createconsumer(file_env.stream, "darkroom", "idle")
        assert await idle.remove_self_if_idle() is True
        assert await streams.remove_consumer_if_idle("nobody", 0) is False
    finally:
        await client.aclose()
    assert consumers(file_env) == {"holder": 1}


async def test_two_replays_of_one_letter_enqueue_it_once(file_env: Env) -> None:
    """Two replays of the same dead letter at once (a double click) enqueue it once."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        streams = Streams(client, file_env.stream, "darkroom", "c", file_env.dead)
        letter = await streams.dead_letter(await streams.enqueue({"photo_id": "p"}), {"a": "b"})
        results = await asyncio.gather(
            *(streams.replay_once(letter, {"photo_id": "p"}) for _ in range(2))
        )
    finally:
        await client.aclose()
    assert sorted(r is None for r in results) == [False, True]
    assert file_env.redis.xlen(file_env.dead) == 0
    assert [f for _, f in file_env.redis.xrange(file_env.stream)] == [{"photo_id": "p"}]


def test_consumers_prune_removes_idle_consumers_with_nothing_pending(file_env: Env) -> None:
    """`consumers prune --idle MS` removes idle consumers with nothing pending, keeps the
    ones holding entries; `--dry-run` only names them; the 1 h default spares fresh ones."""
    r, stream = file_env.redis, file_env.stream
    r.xgroup_create(stream, "darkroom", id="0", mkstream=True)
    r.xadd(stream, {"photo_id": "x"})
    r.xreadgroup("darkroom", "busy", {stream: ">"}, count=1)
    for name in ("gone-1", "gone-2"):
        r.xgroup_createconsumer(stream, "darkroom", name)
    time.sleep(0.05)
    assert set(consumers(file_env)) == {"busy", "gone-1", "gone-2"}
    default = file_env.cli("consumers", "prune")
    assert "removed 0 consumer(s)" in default.stderr
    dry = file_env.cli("consumers", "prune", "--idle", "10", "--dry-run")
    assert sorted(dry.stdout.split()[::3]) == ["gone-1", "gone-2"]
    assert set(consumers(file_env)) == {"busy", "gone-1", "gone-2"}
    file_env.cli("consumers", "prune", "--idle", "10")
    assert consumers(file_env) == {"busy": 1}


def test_status_marks_consumers_idle_past_the_bound() -> None:
    """A consumer idle over 1 h is flagged in `status` with the command that removes it."""
    report = {
        "stream": "s", "length": 0, "group": "g", "lag": 0, "pending": 1,
        "dead_letter_stream": "d", "dead_letters": 0, "photos": {}, "failures": {},
        "consumers": [
            {"name": "old", "pending": 0, "idle_ms": ops.IDLE_BOUND_MS + 1},
            {"name": "new", "pending": 1, "idle_ms": 5},
        ],
    }  # fmt: skip
    ops.mark_idle(report["consumers"])
    assert [c["idle_past_bound"] for c in report["consumers"]] == [True, False]
    lines = ops._format_status(report).splitlines()
    assert "consumers prune" in next(line for line in lines if "old" in line)
    assert "prune" not in next(line for line in lines if "new" in line)


def test_chart_fills_every_bucket_and_scales_to_the_peak() -> None:
    """The throughput chart has one bar pair per bucket, zero where nothing finished."""
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 1, 1, 12, 30, 15, tzinfo=UTC)
    rows = [(datetime(2026, 1, 1, 12, 30, tzinfo=UTC), 4, 1),
            (datetime(2026, 1, 1, 12, 28, tzinfo=UTC), 2, 0)]  # fmt: skip
    buckets = chart.fill(now, rows, "minute", 60)
    assert len(buckets) == 60 and buckets[-1] == (rows[0][0], 4, 1)
    assert buckets[-3] == (rows[1][0], 2, 0)
    assert buckets[0][0] == rows[0][0] - timedelta(minutes=59)
    svg = chart.svg(buckets, "minute", "t")
    assert svg.count('class="ok"') == 60 and ">5</text>" in svg


def test_session_cookies_are_signed_and_csrf_tokens_bound_to_them() -> None:
    """A tampered or foreign cookie is refused; a CSRF token fits only its own session;
    another token (rotation) invalidates every session."""
    auth = Auth("a" * 20)
    session, cookie = auth.new_session(operator=True)
    assert auth.read_session(cookie) == session
    nonce, _, issued, signature = cookie.split(".")
    assert auth.read_session(f"{nonce}.1.{issued}.{signature[:-2]}xx") is None
    _, anonymous = auth.new_session(operator=False)
    forged = ".".join([*anonymous.split(".")[:1], "1", *anonymous.split(".")[2:]])
    assert auth.read_session(forged) is None
    other, _ = auth.new_session(operator=True)
    assert auth.csrf_ok(session, auth.csrf_token(session))
    assert not auth.csrf_ok(session, auth.csrf_token(other)) and not auth.csrf_ok(session, None)
    assert Auth("b" * 20).read_session(cookie) is None
    assert (auth.bearer(None), auth.bearer("Bearer " + "a" * 20), auth.bearer("Bearer x")) == (
        "none", "ok", "wrong")  # fmt: skip


# -- alert rules ------------------------------------------------------------------------------


def exported_metrics() -> set[str]:
    """Every sample name darkroom exports (workers and `darkroom web`)."""
    from prometheus_client.metrics import MetricWrapperBase

    names: set[str] = set()
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            base = obj._name
            names.update(base + suffix for suffix in suffixes[obj._type])
    return names


def test_every_alert_names_only_exported_metrics() -> None:
    """Each alert expression uses only metrics darkroom exports, with labels they carry."""
    rules = yaml.safe_load((ALERTS / "alerts.yaml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {
        "DarkroomBacklogGrowing", "DarkroomNoPhotoFinished", "DarkroomFailureRateHigh",
        "DarkroomDependencyDown", "DarkroomDeadLettersGrowing"}  # fmt: skip
    exported = exported_metrics()
    for rule in rules:
        used = set(re.findall(r"\bdarkroom_[a-z_]+", rule["expr"]))
        assert used and used <= exported, (rule["alert"], used - exported)
        assert rule["labels"]["severity"] in ("warning", "critical")


def promtool() -> str:
    found = shutil.which("promtool") or str(ROOT / ".venv" / "bin" / "promtool")
    assert Path(found).exists(), "promtool missing: `make test` unpacks it from Debian's package"
    return found


def test_promtool_checks_the_rules_and_their_unit_tests() -> None:
    """`promtool check rules` accepts the file and `promtool test rules` fires each alert
    on its pattern (and the stall alert not while photos finish)."""
    for command in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        result = subprocess.run(
            [promtool(), *command], cwd=ALERTS, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout


def test_a_worker_exports_which_dependency_it_sees_down(file_env: Env) -> None:
    """The worker's /metrics has darkroom_dependency_down per dependency (0 while all is
    well), the gauge the DarkroomDependencyDown alert reads."""
    port = free_port()
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port))
    deadline, body = time.monotonic() + 30, ""
    while 'darkroom_dependency_down{dependency="storage"}' not in body:
        assert time.monotonic() < deadline and worker.poll() is None
        time.sleep(0.2)
        with contextlib.suppress(OSError):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
            body = body.decode()
    for dependency in ("queue", "database", "storage"):
        assert f'darkroom_dependency_down{{dependency="{dependency}"}} 0.0' in body
    down: set[str] = set()
    metrics.watch_outages(down, ["queue"])
    down.add("queue")
    sample = REGISTRY.get_sample_value("darkroom_dependency_down", {"dependency": "queue"})
    assert sample == 1.0
