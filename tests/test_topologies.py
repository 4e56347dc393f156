"""DARKROOM_REDIS_URL topologies against real servers started here on loopback ports: a
Sentinel failover mid-batch, a 3-node Redis Cluster (worker and every operator command),
and TLS (rediss://) with a throwaway CA."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster

from darkroom.config.env import from_env
from darkroom.config.redis_url import parse_redis_url
from darkroom.errors import SettingsError
from darkroom.queue.streams import Streams, connect
from tests import redis_rig
from tests.conftest import PHOTOS, Env, env_vars
from tests.redis_rig import SERVICE, Servers, wait_until

LANDSCAPES = sorted(PHOTOS.glob("Landscape_*.jpg"))
HEIC = PHOTOS / "iphone_13_pro_max.HEIC"  # about a second to render


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    rig = Servers(tmp_path / "redis")
    yield rig
    rig.close()


@pytest.fixture
def tls_servers(tmp_path: Path) -> Iterator[Servers]:
    """TLS-only servers whose certificate a throwaway CA signed."""
    rig = Servers(tmp_path / "redis-tls", redis_rig.make_certificates(tmp_path / "certs"))
    yield rig
    rig.close()


EnvFor = Callable[[str, Any], Env]


@pytest.fixture
def env_for(servers: Servers, tmp_path: Path, database_url: str) -> Iterator[EnvFor]:
    """Builds the Env for a Redis URL; its workers are killed before the servers go."""
    envs: list[Env] = []

    def build(redis_url: str, client: Any) -> Env:
        storage = {"DARKROOM_STORAGE_URL": "file:./var/storage"}
        envs.append(Env(env_vars(database_url, storage, redis_url), client, tmp_path))
        return envs[-1]

    yield build
    for env in envs:
        env.kill_workers()


def stop(env: Env) -> str:
    """SIGTERM every worker; returns their stderr (JSON logs)."""
    logs = []
    for proc in env.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        logs.append(proc.communicate(timeout=60)[1])
        assert proc.returncode == 0, logs[-1][-3000:]
    return "".join(logs)


def events(log: str, name: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [e for e in lines if e.get("event") == name]


def jobs(env: Env, ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    return env.query(
        "SELECT p.processing_state, p.visibility, j.attempt, j.error_code FROM photos p"
        " JOIN photo_jobs j ON j.photo_id = p.id WHERE p.id = ANY($1::uuid[])",
        ids,
    )


def published(env: Env, ids: list[uuid.UUID]) -> int:
    return sum(row["processing_state"] == "processed" for row in jobs(env, ids))


def stream_settled(client: Any, env: Env) -> bool:
    """Nothing left in the work stream, nothing pending in the group."""
    return client.xlen(env.stream) == 0 and client.xpending(env.stream, "darkroom")["pending"] == 0


# -- Sentinel -------------------------------------------------------------------------------


def test_sentinel_failover_mid_batch_costs_nothing(servers: Servers, env_for: EnvFor) -> None:
    """A forced SENTINEL FAILOVER mid-batch: the worker follows the new primary; every
    photo published, nothing dead-lettered, no photo failed an attempt, stream empty."""
    primary, replica, sentinels = redis_rig.sentinel_setup(servers)
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in sentinels) + f"/{SERVICE}/0"
    env = env_for(url, None)
    paths = [*LANDSCAPES, *LANDSCAPES, HEIC, HEIC, *LANDSCAPES]
    ids = env.ingest(paths)
    with servers.client(primary) as old:
        assert old.wait(1, 5000) == 1  # the batch is on the replica before the failover
    env.start("run", DARKROOM_CLAIM_IDLE_MS="5000")
    wait_until(lambda: published(env, ids) >= 1, "first photo published", 60)
    with servers.client(sentinels[0]) as sentinel:
        assert sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
    before = published(env, ids)
    wait_until(lambda: redis_rig.primary_port(servers, sentinels[-1]) == replica, "failover")
    wait_until(lambda: redis_rig.role(servers, primary) == "slave", "old primary demoted", 60)
    new = servers.client(replica)
    wait_until(lambda: published(env, ids) == len(ids), "every photo published", 120)
    wait_until(lambda: stream_settled(new, env), "stream empty on the new primary", 60)
    log = stop(env)
    rows = jobs(env, ids)
    assert before < len(ids), "the failover came after the batch"
    assert all(r["processing_state"] == "processed" for r in rows)
    assert all(r["visibility"] == "published" and r["error_code"] is None for r in rows)
    assert new.xlen(env.dead) == 0
    assert not events(log, "attempt failed; will retry")
    assert not events(log, "photo failed; dead-lettered")
    # A photo in flight while the old primary was demoted can be delivered once more by the
    # new one (its read never reached the replica): that second delivery may claim it again.
    assert all(r["attempt"] <= 2 for r in rows), rows
    new.close()


# -- Cluster --------------------------------------------------------------------------------


def test_cluster_processes_a_batch_and_every_command_works(
    servers: Servers, env_for: EnvFor, tmp_path: Path
) -> None:
    """On a 3-node cluster: ingest, run --drain, status, dlq list/replay, retry and
    enqueue all work; the bad photo is dead-lettered, replayed and failed again."""
    ports = redis_rig.cluster_setup(servers)
    url = f"redis+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[2], decode_responses=True)
    env = env_for(url, client)
    bogus = tmp_path / "not-a-photo.jpg"
    bogus.write_text("plain text, not an image")
    ids = env.ingest([*LANDSCAPES, bogus])
    good, bad = ids[:-1], ids[-1]
    env.cli("run", "--drain")
    rows = {r["processing_state"] for r in jobs(env, good)}
    assert rows == {"processed"}
    assert client.xlen(env.dead) == 1 and stream_settled(client, env)

    status = json.loads(env.cli("status", "--json").stdout)
    assert status["photos"]["processed"] == len(good)
    assert status["photos"]["processing_failed"] == 1
    assert (status["length"], status["pending"], status["dead_letters"]) == (0, 0, 1)
    listed = env.cli("dlq", "list").stdout
    assert str(bad) in listed and "unsupported_format" in listed

    assert "replayed as" in env.cli("dlq", "replay").stdout
    assert client.xlen(env.dead) == 0 and client.xlen(env.stream) == 1
    env.cli("run", "--drain")
    assert client.xlen(env.dead) == 1 and stream_settled(client, env)

    assert str(bad) in env.cli("retry", str(bad)).stdout
    env.cli("enqueue", str(good[0]))
    assert client.xlen(env.stream) == 2
    log = env.cli("run", "--drain").stderr
    assert [e["outcome"] for e in events(log, "entry done")] == ["already"]
    assert [e["photo_id"] for e in events(log, "photo failed; dead-lettered")] == [str(bad)]
    assert client.xlen(env.dead) == 2 and stream_settled(client, env)
    client.close()


def test_cluster_mode_refuses_streams_in_two_slots() -> None:
    """Both streams must hash to one slot: settings name the variable otherwise."""
    environ = {
        "DARKROOM_REDIS_URL": "redis+cluster://127.0.0.1:7000",
        "DARKROOM_STREAM": "{a}:photos",
        "DARKROOM_DEAD_LETTER_STREAM": "{b}:dead",
    }
    with pytest.raises(SettingsError, match="DARKROOM_DEAD_LETTER_STREAM"):
        from_env(environ)


# -- TLS ------------------------------------------------------------------------------------


def test_rediss_with_a_private_ca(tls_servers: Servers, env_for: EnvFor) -> None:
    """rediss:// with ?ssl_ca_certs= processes a batch over TLS; without the CA the
    certificate is refused (queue_unavailable, exit 1)."""
    assert tls_servers.certs is not None
    port = tls_servers.start("tls")
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tls_servers.certs['ca']}"
    client = tls_servers.client(port)
    env = env_for(url, client)
    ids = env.ingest(LANDSCAPES[:3])
    env.cli("run", "--drain")
    assert {r["processing_state"] for r in jobs(env, ids)} == {"processed"}
    assert stream_settled(client, env)
    assert json.loads(env.cli("status", "--json").stdout)["photos"]["processed"] == 3
    untrusted = env.cli("status", check=False, DARKROOM_REDIS_URL=f"rediss://127.0.0.1:{port}/0")
    assert untrusted.returncode == 1 and "queue_unavailable" in untrusted.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    client.close()


def test_redis_urls_name_nodes_service_and_options() -> None:
    """The URL forms parse into what redis-py's Sentinel and cluster clients take."""
    target = parse_redis_url(
        "rediss+sentinel://u:p%40ss@s1,[::1]:26380/svc/2?sentinel_password=x&ssl_ca_certs=/ca"
    )
    assert (target.topology, target.tls, target.service, target.db) == ("sentinel", True, "svc", 2)
    assert target.nodes == (("s1", 26379), ("::1", 26380))
    assert (target.username, target.password) == ("u", "p@ss")
    assert target.options == {"sentinel_password": "x", "ssl_ca_certs": "/ca"}
    cluster = parse_redis_url("redis+cluster://h1:7000,h2:7001?socket_timeout=8")
    assert (cluster.topology, cluster.nodes) == ("cluster", (("h1", 7000), ("h2", 7001)))
    assert cluster.options == {"socket_timeout": 8.0}
    assert parse_redis_url("unix:///run/redis.sock?db=3").unix_path == "/run/redis.sock"
    assert parse_redis_url("unix:///run/redis.sock?db=3").db == 3


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+sentinel://127.0.0.1:26379", "service name"),
        ("redis+cluster://127.0.0.1:7000/2", "database 0"),
        ("redis://a:1,b:2", "several hosts"),
        ("redis://127.0.0.1?ssl_ca_certs=/ca.pem", "needs TLS"),
        ("redis://127.0.0.1?retries=3", "unknown option"),
        ("redis://127.0.0.1?socket_timeout=2", "must exceed DARKROOM_READ_BLOCK_MS"),
        ("memcached://127.0.0.1", "scheme"),
    ],
)
def test_bad_redis_urls_are_refused(url: str, reason: str) -> None:
    """A malformed DARKROOM_REDIS_URL stops start-up with the reason."""
    with pytest.raises(SettingsError, match=reason) as caught:
        from_env({"DARKROOM_REDIS_URL": url})
    assert caught.value.variable == "DARKROOM_REDIS_URL"


# -- Every stream command, on each topology ---------------------------------------------------


@pytest.fixture(
    params=[
        ("redis", "single"), ("redis", "sentinel"), ("redis", "cluster"),
        ("rediss", "single"), ("rediss", "sentinel"), ("rediss", "cluster"),
    ],
    ids=lambda p: f"{p[0]}-{p[1]}",
)  # fmt: skip
def topology_url(request: pytest.FixtureRequest, servers: Servers, tls_servers: Servers) -> str:
    scheme, topology = request.param
    rig = tls_servers if scheme == "rediss" else servers
    query = f"?ssl_ca_certs={rig.certs['ca']}" if rig.certs else ""
    if topology == "sentinel":
        _primary, _replica, sentinels = redis_rig.sentinel_setup(rig, sentinels=1)
        return f"{scheme}+sentinel://127.0.0.1:{sentinels[0]}/{SERVICE}{query}"
    if topology == "cluster":
        nodes = ",".join(f"127.0.0.1:{p}" for p in redis_rig.cluster_setup(rig))
        return f"{scheme}+cluster://{nodes}{query}"
    return f"{scheme}://127.0.0.1:{rig.start('single')}/0{query}"


async def test_every_stream_command_works_on_each_topology(topology_url: str) -> None:
    """Each Streams method, including the ack/dead-letter/replay scripts and the sweeper's
    pipeline and the intake's delivery point, behaves the same on one node, behind Sentinel
    and on a Cluster, with and without TLS; an entry's bytes are read as sent."""
    tag = uuid.uuid4().hex[:8]
    streams = Streams(connect(topology_url), f"{{{tag}}}:photos", "g", "me", f"{{{tag}}}:dead")
    other = Streams(streams.client, streams.stream, "g", "other", streams.dead_stream)
    try:
        await streams.probe()
        await streams.reconnect()
        assert await streams.delivery_point() == ("0-0", None)  # no stream: nothing waits
        await streams.ensure_group()
        await streams.ensure_group()  # BUSYGROUP is fine
        ids = [await streams.enqueue({"photo_id": str(n)}) for n in range(4)]
        assert await streams.oldest_entry_ms() == int(ids[0].split("-")[0])
        assert await streams.delivery_point() == (ids[3], ids[0])
        assert [e.id for e in await streams.read_new(3, 100)] == ids[:3]
        assert await streams.delivery_point() == (ids[3], ids[3])
        assert await streams.deliveries(ids[0]) == 1 and await streams.pending_count() == 3
        assert await streams.heartbeat(ids[:3]) == set(ids[:3])
        assert await streams.backoff(ids[1], 60_000)
        claimed, deleted = await other.reclaim(30_000, 10)
        assert [e.id for e in claimed] == [ids[1]] and deleted == []
        assert [e.id for e in await streams.read_own_pending(10)] == [ids[0], ids[2]]
        await streams.ack(ids[0])
        dead_id = await streams.dead_letter(ids[2], {"photo_id": "2", "error_code": "x"})
        assert [e.id for e in await streams.dead_letter_page("-", 10)] == [dead_id]
        assert await streams.missing(ids) == {ids[0], ids[2]}
        new_id = await streams.replay_once(dead_id, {"photo_id": "2"})
        assert await streams.dead_letter_page("-", 10) == [] and new_id not in ids
        assert await streams.replay_once(dead_id, {"photo_id": "2"}) is None, "only once"
        status = await streams.status()
        assert (status["length"], status["pending"], status["dead_letters"]) == (3, 1, 0)
        assert {c["name"] for c in status["consumers"]} == {"me", "other"}
        await streams.client.xgroup_destroy(streams.stream, "g")
        # without the group every entry waits (a new one would read from the start)
        assert await streams.delivery_point() == (new_id, ids[1])
        await other.ack(ids[1])  # the group is gone: a no-op that still deletes the entry
        assert await streams.missing([ids[1]]) == {ids[1]}
        await streams.dead_letter(ids[3], {"photo_id": "3"})
        assert len(await streams.dead_letter_page("-", 10)) == 1
        await streams.ensure_group()  # an entry is read as the bytes sent, repeats included
        raw = [b"note", b"\xff\xfe", b"note", b"x"]
        bad = await streams.client.execute_command("XADD", streams.stream, "*", *raw)
        read = {e.id: e for e in await streams.read_new(10, 100)}
        assert read[bad].sent == tuple(raw) and read[bad].fields == {"note": "x"}
    finally:
        await streams.client.delete(streams.stream)
        await streams.client.delete(streams.dead_stream)
        await streams.client.aclose()
