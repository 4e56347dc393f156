"""The command line as operators use it: settings errors, migrate, status, SIGTERM."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid

import pytest
import redis

from tests.conftest import PG_BASE, PHOTOS, REDIS_URL, Env, _admin, free_port
from tests.test_recovery import log_lines


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DARKROOM_CONCURRENCY", "zero"),
        ("DARKROOM_CONCURRENCY", "0"),
        ("DARKROOM_STORAGE_URL", "ftp://somewhere"),
        ("DARKROOM_RENDITIONS", "thumb:320:gif"),
        ("DARKROOM_SHUTDOWN_GRACE_S", "-1"),
        ("DARKROOM_CLAIM_IDLE_MS", "1"),
        ("DARKROOM_CONCURRENCYY", "2"),
    ],
)
def test_bad_setting_exits_2_naming_the_variable(file_env: Env, variable: str, value: str) -> None:
    """A malformed or unknown DARKROOM_* variable stops start-up with exit 2 and its name."""
    result = file_env.cli("run", check=False, **{variable: value})
    assert result.returncode == 2
    assert variable in result.stderr and "invalid setting" in result.stderr
    assert "Traceback" not in result.stderr


def test_passwords_are_masked_in_errors_status_and_logs(file_env: Env) -> None:
    """With passwords in the Redis and PostgreSQL URLs, a refused URL's error (`check`),
    `status` (text and JSON) and the worker's log name the servers with the passwords
    masked, never in clear."""
    secret = f"pw-{uuid.uuid4().hex}"
    bad = file_env.cli("check", check=False, DARKROOM_REDIS_URL=f"redis://:{secret}@host:abc")
    assert bad.returncode == 2 and "DARKROOM_REDIS_URL" in bad.stderr
    file_env.ingest([PHOTOS / "4.webp"])
    user = f"darkroom_{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(REDIS_URL)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{secret}"], keys=["*"],
                      commands=["+@all"])  # fmt: skip
    urls = {
        "DARKROOM_REDIS_URL": REDIS_URL.replace("redis://", f"redis://{user}:{secret}@"),
        "DARKROOM_DATABASE_URL": file_env.database_url.replace("postgres@", f"postgres:{secret}@"),
    }
    try:
        ran = [file_env.cli(*args, **urls) for args in (["status"], ["status", "--json"],
                                                        ["run", "--drain"])]  # fmt: skip
    finally:
        admin.acl_deluser(user)
        admin.close()
    outputs = [bad.stderr] + [text for r in ran for text in (r.stdout, r.stderr)]
    assert [text for text in outputs if secret in text] == []
    servers = json.loads(ran[1].stdout)["servers"]
    assert servers["redis"] == REDIS_URL.replace("redis://", f"redis://{user}:***@")
    assert f"redis         {servers['redis']}" in ran[0].stdout
    started = next(e for e in log_lines(ran[2].stderr) if e["event"] == "worker started")
    assert (started["redis"], started["database"]) == (servers["redis"], servers["database"])
    assert ":***@" in started["database"]


def test_unreachable_database_is_a_clear_error(file_env: Env) -> None:
    """A dead database URL ends with exit 1 and the database_unavailable code, no traceback."""
    result = file_env.cli(
        "status", check=False, DARKROOM_DATABASE_URL="postgresql://postgres@127.0.0.1:1/x"
    )
    assert result.returncode == 1
    assert "database_unavailable" in result.stderr and "Traceback" not in result.stderr


def test_migrate_creates_the_database_and_is_idempotent(file_env: Env) -> None:
    """`darkroom migrate` creates a missing database, and running it again changes nothing."""
    name = f"darkroom_m_{uuid.uuid4().hex[:10]}"
    url = f"{PG_BASE}/{name}"
    try:
        first = file_env.cli("migrate", DARKROOM_DATABASE_URL=url)
        second = file_env.cli("migrate", DARKROOM_DATABASE_URL=url)
        assert "created" in first.stdout and "created" not in second.stdout
        env = Env({**file_env.vars, "DARKROOM_DATABASE_URL": url}, file_env.redis, file_env.tmp)
        tables = env.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        names = {
            "photos",
            "photo_jobs",
            "photo_attempts",
            "photo_events",
            "darkroom_duties",
            "operator_actions",
            "bulk_action_items",
            "queue_pauses",
            "darkroom_schema",
        }
        assert {t["tablename"] for t in tables} == names
        applied = env.query("SELECT sha256 FROM darkroom_schema")
        assert len(applied) == 1, "a re-run on a current schema applies nothing"
    finally:
        _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_schema_refuses_a_published_half_made_photo(file_env: Env) -> None:
    """The database itself rejects visibility=published on a photo that is not processed."""
    photo_id = uuid.uuid4()
    file_env.query("INSERT INTO photos (id, original_key) VALUES ($1, 'k')", photo_id)
    with pytest.raises(Exception, match="photos_published_is_processed"):
        file_env.query("UPDATE photos SET visibility = 'published' WHERE id = $1", photo_id)
    with pytest.raises(Exception, match="photos_processing_state_check"):
        file_env.query("UPDATE photos SET processing_state = 'done' WHERE id = $1", photo_id)


def test_status_json_reports_stream_group_and_photos(file_env: Env) -> None:
    """`status --json` shows backlog, pending, dead letters and photos by state."""
    file_env.ingest([PHOTOS / "4.webp", PHOTOS / "animated-loop-3.gif"])
    report = json.loads(file_env.cli("status", "--json").stdout)
    assert report["length"] == 2 and report["pending"] == 0 and report["lag"] == 2
    assert report["photos"] == {"uploaded": 2}
    file_env.cli("run", "--drain")
    report = json.loads(file_env.cli("status", "--json").stdout)
    assert (report["length"], report["pending"], report["dead_letters"]) == (0, 0, 0)
    assert report["photos"] == {"processed": 2}
    text = file_env.cli("status").stdout
    assert "processed" in text and file_env.stream in text
    # the run held the single runners' duties and gave them up as it exited
    held = {d["name"]: d for d in report["duties"]}
    assert {"feeder", "relay", "sweep"} <= set(held)
    assert all(d["token"] >= 1 and d["expires_in_s"] <= 0 for d in held.values())
    assert "duties" in text and held["feeder"]["holder"] in text


def test_sigterm_mid_batch_finishes_in_flight_and_loses_nothing(file_env: Env) -> None:
    """SIGTERM: stop reading, finish and ack in-flight photos, exit 0; next run does the rest."""
    paths = sorted(PHOTOS.glob("Landscape_*.jpg")) * 2
    ids = file_env.ingest(paths)
    worker = file_env.start("run")
    deadline = time.monotonic() + 60
    while not file_env.query("SELECT 1 FROM photos WHERE processing_state = 'processed'"):
        assert time.monotonic() < deadline and worker.poll() is None
        time.sleep(0.05)
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    states = {r["processing_state"] for r in file_env.query("SELECT processing_state FROM photos")}
    assert states <= {"processed", "uploaded"}, "in-flight photos were finished and committed"
    left = file_env.query("SELECT id FROM photos WHERE processing_state = 'uploaded'")
    assert left, "the signal arrived mid-batch"
    queued = {fields["photo_id"] for _, fields in file_env.redis.xrange(file_env.stream)}
    assert {str(r["id"]) for r in left} <= queued, "every unfinished photo is still in the stream"
    file_env.cli("run", "--drain")
    done = file_env.query("SELECT id FROM photos WHERE processing_state = 'processed'")
    assert len(done) == len(ids)
    assert file_env.redis.xlen(file_env.stream) == 0


def test_metrics_and_health_endpoints(file_env: Env) -> None:
    """/livez, /readyz and Prometheus /metrics answer on DARKROOM_METRICS_PORT."""
    port = free_port()
    file_env.ingest([PHOTOS / "4.webp"])
    worker = file_env.start("run", DARKROOM_METRICS_PORT=str(port))
    deadline = time.monotonic() + 60
    while not file_env.query("SELECT 1 FROM photos WHERE processing_state = 'processed'"):
        assert time.monotonic() < deadline and worker.poll() is None
        time.sleep(0.05)

    def get(path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()

    assert get("/livez") == (200, "ok\n")
    assert get("/readyz")[0] == 200
    status, body = get("/metrics")
    assert status == 200
    assert 'darkroom_entries_total{outcome="published"} 1.0' in body
    assert "darkroom_stage_seconds_bucket" in body and "darkroom_render_peak_rss_mb" in body
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    assert worker.returncode == 0


def test_help_says_what_darkroom_is_and_each_command_shows_an_example(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`darkroom --help` describes the service and points to docs/; every command's help
    ends with an example of its use."""
    from darkroom.cli import main
    from darkroom.cli_parser import SUBCOMMANDS

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "renditions users see" in top and "docs/configuration.md" in top
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        example = capsys.readouterr().out.split("example:\n  ")[1]
        assert f"darkroom {name}" in example
