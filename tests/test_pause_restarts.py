"""A pause outlives Redis and every replica: its truth is PostgreSQL's `queue_pauses`. With
a lane and a tenant paused, the test's own redis-server (no persistence) is SIGKILLed and
started empty on the same port, and the worker with it; the new worker starts nothing of
either scope, though the sweep puts the lost entries back, until they are resumed, and
then processes every one on its first attempt."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.rig import wait_until
from tests.conftest import PHOTOS, Env
from tests.redis_rig import Servers
from tests.test_lanes_e2e import BULK_PHOTOS, ingest
from tests.test_pause import QUICK, all_processed, attempts, stop

# The sweep looks every second and re-enqueues a photo idle 2 s whose entry is gone.
SWEPT = {**QUICK, "DARKROOM_SWEEP_AFTER_S": "2"}
# Long enough for the sweep to re-enqueue the lost entries and for a refused entry to be
# looked at again (DARKROOM_CLAIM_IDLE_MS 2 s) a few times: each a chance to start it.
WATCH_S = 8.0


@pytest.fixture
def own_redis(tmp_path: Path, file_env: Env) -> Iterator[tuple[Servers, int]]:
    """A redis-server of this test on a free loopback port, `file_env` pointed at it."""
    servers = Servers(tmp_path / "redis")
    port = servers.start("redis")
    file_env.vars["DARKROOM_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    yield servers, port
    file_env.kill_workers()
    servers.close()


def restart_empty(servers: Servers, port: int) -> None:
    """SIGKILL the server and start a new one on its port: every stream and group gone."""
    servers.procs[-1].kill()
    servers.procs[-1].wait(10)
    servers.start("redis", port=port)


def requeued(servers: Servers, port: int, stream: str, photo_id: uuid.UUID) -> bool:
    """Is the photo's entry back in the (new) work stream?"""
    with servers.client(port) as client:
        return any(f["photo_id"] == str(photo_id) for _, f in client.xrange(stream))


def test_a_paused_lane_and_tenant_stay_paused_through_a_redis_and_worker_restart(
    file_env: Env, own_redis: tuple[Servers, int]
) -> None:
    """Bulk and acme paused, a worker running: zed's upload is processed, no acme or bulk
    photo is claimed; Redis and the worker SIGKILLed, Redis started empty and a new
    worker: zed's next upload is processed, acme and bulk still unclaimed while the sweep
    re-enqueues them; resumed, each is processed on its first attempt, nothing dead."""
    servers, port = own_redis
    file_env.cli("pause", "--lane", "bulk", "--reason", "import on hold", **QUICK)
    file_env.cli("pause", "--tenant", "acme", "--reason", "over quota", **QUICK)
    held = ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "acme")
    held += ingest(file_env, BULK_PHOTOS[:3], "--lane", "bulk", "--tenant", "library")
    first = file_env.start("run", **SWEPT)
    all_processed(file_env, ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "zed"), first)
    assert set(attempts(file_env, held).values()) == {0}, "a paused photo was claimed"
    first.kill()
    first.communicate()
    restart_empty(servers, port)
    with servers.client(port) as fresh:
        assert fresh.dbsize() == 0, "the new redis-server kept data"
    second = file_env.start("run", **SWEPT)
    all_processed(file_env, ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "zed"), second)
    wait_until(lambda: requeued(servers, port, file_env.stream, held[0]), "the sweep", 90)
    time.sleep(WATCH_S)
    assert set(attempts(file_env, held).values()) == {0}, "a paused photo started after restart"
    file_env.cli("resume", **QUICK)
    all_processed(file_env, held, second)
    assert set(attempts(file_env, held).values()) == {1}, "the restart cost an attempt"
    with servers.client(port) as fresh:
        assert fresh.xlen(file_env.dead) == 0
    stop(second)


def test_a_redis_restart_loses_no_pause_that_a_timed_one_ends_on_its_own(
    file_env: Env, own_redis: tuple[Servers, int]
) -> None:
    """A pause `--for 15s` of acme, Redis restarted empty meanwhile: the worker starts
    acme's photo only once the time ran out, and the pause ends with one `resumed` event
    (expired) and one audit row via `timer`."""
    servers, port = own_redis
    worker = file_env.start("run", **SWEPT)
    all_processed(file_env, ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "zed"), worker)
    file_env.cli("pause", "--tenant", "acme", "--reason", "a moment", "--for", "15s", **QUICK)
    [until] = file_env.query("SELECT (data->>'until')::timestamptz AS until FROM photo_events"
                             " WHERE type = 'darkroom.queue.paused'")  # fmt: skip
    [held] = ingest(file_env, [PHOTOS / "4.webp"], "--tenant", "acme")
    restart_empty(servers, port)
    all_processed(file_env, [held], worker)
    [started] = file_env.query("SELECT started_at FROM photo_jobs WHERE photo_id = $1", held)
    assert started["started_at"] >= until["until"], "acme's photo started while paused"
    assert attempts(file_env, [held]) == {held: 1}
    resumed = file_env.query("SELECT data FROM photo_events WHERE type = $1",
                             "darkroom.queue.resumed")  # fmt: skip
    assert len(resumed) == 1 and '"expired": true' in resumed[0]["data"]
    timer = file_env.query("SELECT operator FROM operator_actions WHERE via = 'timer'")
    assert len(timer) == 1
    stop(worker)
