"""Production faults, in-process against real servers: each driver error is classified by
what it says about the dependency; probes exercise writes; the gate waits an outage out
with capped backoff and a bounded number of log lines (a controlled clock); heartbeats
and retries touch only what this consumer owns; a local folder's writes are on disk
before they return."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
import redis
import redis.asyncio
from redis import exceptions as rx
from structlog.testing import capture_logs

from darkroom import errors
from darkroom.errors import (
    DatabaseUnavailableError,
    InternalError,
    ObjectForbiddenError,
    QueueUnavailableError,
    StorageUnavailableError,
)
from darkroom.health import Gate
from darkroom.queue import streams
from darkroom.queue.inflight import InFlight
from darkroom.queue.pacing import Backoff, Throttle
from darkroom.queue.streams import Streams
from darkroom.store import db, leases, probe, storage
from darkroom.store.storage import files as file_storage
from darkroom.store.storage import s3 as s3_storage
from tests.conftest import AWS_ENV, REDIS_URL, free_port
from tests.faults import DenyingS3Proxy, FakeClock, pg_admin, spare_redis


@pytest.fixture
def spare(tmp_path: Path) -> Iterator[int]:
    yield from spare_redis(tmp_path)


def _streams(client: Any, consumer: str = "c1") -> Streams:
    tag = uuid.uuid4().hex[:8]
    return Streams(client, f"{{f{tag}}}:photos", "darkroom", consumer, f"{{f{tag}}}:dead")


@pytest.fixture
async def spare_streams(spare: int) -> AsyncIterator[Streams]:
    client = redis.asyncio.Redis(port=spare, decode_responses=True)
    s = _streams(client)
    await s.ensure_group()
    yield s
    await client.aclose()


# -- the tables: every row, with its reason and whether it is transient ---------------------

T, P = True, False
REDIS_FAULTS = [
    (rx.ReadOnlyError("You can't write against a read only replica."), "read_only", T),
    (rx.BusyLoadingError("Redis is loading the dataset in memory"), "loading", T),
    (rx.MasterDownError("Link with MASTER is down"), "master_down", T),
    (rx.ClusterDownError("The cluster is down"), "cluster_down", T),
    (rx.TryAgainError("Multiple keys request during rehashing"), "cluster_down", T),
    (rx.RedisClusterException("Redis Cluster cannot be connected"), "cluster_unreachable", T),
    (rx.OutOfMemoryError("used memory > 'maxmemory'"), "out_of_memory", T),
    (rx.AuthenticationError("invalid username-password pair"), "auth", P),
    (rx.NoPermissionError("this user has no permissions"), "no_permission", P),
    (rx.ResponseError("MISCONF Redis is configured to save RDB snapshots"), "misconf", T),
    (rx.ResponseError("WRONGTYPE Operation against a key of the wrong kind"), "wrong_type", P),
    (rx.ResponseError("NOGROUP No such key or consumer group"), "no_group", P),
    (rx.TimeoutError("Timeout reading from socket"), "timeout", T),
    (TimeoutError(), "timeout", T),
    (rx.ConnectionError("Connection refused"), "connection", T),
    (ConnectionResetError("reset by peer"), "connection", T),
    (rx.ResponseError("ERR something new"), "error", P),
]
POSTGRES_FAULTS = [
    (
        asyncpg.ReadOnlySQLTransactionError("cannot execute UPDATE in a read-only transaction"),
        "read_only",
        T,
    ),
    (asyncpg.InvalidPasswordError("password authentication failed"), "auth", P),
    (asyncpg.InvalidAuthorizationSpecificationError('role "x" is not permitted'), "auth", P),
    (
        asyncpg.InsufficientPrivilegeError("permission denied for table photos"),
        "permission_denied",
        P,
    ),
    (asyncpg.CannotConnectNowError("the database system is starting up"), "starting_up", T),
    (
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        "shutdown",
        T,
    ),
    (asyncpg.QueryCanceledError("canceling statement due to user request"), "terminated", T),
    (asyncpg.TooManyConnectionsError("too many clients already"), "too_many_connections", T),
    (asyncpg.DiskFullError("could not extend file"), "resources", T),
    (asyncpg.InvalidCatalogNameError('database "x" does not exist'), "database_missing", P),
    (asyncpg.UndefinedTableError('relation "photos" does not exist'), "schema_missing", P),
    (asyncpg.SerializationError("could not serialize access"), "conflict", T),  # 40001
    (asyncpg.DeadlockDetectedError("deadlock detected"), "conflict", T),  # 40P01
    (asyncpg.ConnectionDoesNotExistError("connection was closed"), "connection", T),
    (asyncpg.InternalClientError("cannot switch to state 12"), "connection", T),
    (OSError("Connection refused"), "connection", T),
    (TimeoutError(), "timeout", T),
    (asyncpg.UndefinedColumnError("column x does not exist"), "schema_mismatch", P),  # 42703
    (asyncpg.UndefinedFunctionError("function f(int) does not exist"), "schema_mismatch", P),
    (asyncpg.PostgresSyntaxError('syntax error at or near "x"'), "sql", P),
]


def _s3(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    error = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(error, "PutObject")


def _botocore(name: str, **kwargs: Any) -> Exception:
    from botocore import exceptions as bx

    exc: Exception = getattr(bx, name)(**kwargs)
    return exc


S3_FAULTS = [
    (lambda: _s3("AccessDenied", 403), "access_denied", P),
    (lambda: _s3("InvalidAccessKeyId", 403), "access_denied", P),
    (lambda: _s3("RequestTimeTooSkewed", 403), "clock_skew", P),
    (lambda: _s3("SlowDown", 503), "throttled", T),
    (lambda: _s3("RequestTimeout", 400), "throttled", T),
    (lambda: _s3("Throttling", 400), "throttled", T),
    (lambda: _s3("NoSuchBucket", 404), "no_such_bucket", P),
    (lambda: _s3("InternalError", 500), "server_error", T),
    (lambda: _s3("ServiceUnavailable", 503), "server_error", T),
    (lambda: _botocore("NoCredentialsError"), "credentials", P),
    (lambda: _botocore("ReadTimeoutError", endpoint_url="http://s3"), "timeout", T),
    (lambda: _botocore("EndpointConnectionError", endpoint_url="http://s3"), "connection", T),
    (lambda: ConnectionResetError("reset by peer"), "connection", T),
    (lambda: _s3("InvalidArgument", 400), "error", P),
]
FILE_FAULTS = [
    (OSError(errno.EAGAIN, "Resource temporarily unavailable"), "busy", T),
    (OSError(errno.ESTALE, "Stale file handle"), "busy", T),
    (OSError(errno.ETIMEDOUT, "Connection timed out"), "busy", T),
    (OSError(errno.ENOSPC, "No space left on device"), "resources", T),
    (IsADirectoryError(errno.EISDIR, "Is a directory"), "io", P),
    (PermissionError(errno.EACCES, "Permission denied"), "io", P),
    (OSError(errno.EROFS, "Read-only file system"), "io", P),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "reason", "transient"), REDIS_FAULTS)
def test_every_redis_fault_is_a_queue_error_with_its_reason_and_kind(
    exc: Exception, reason: str, transient: bool
) -> None:
    """Each Redis failure becomes queue_unavailable, naming what happened and whether a later
    try may succeed (transient: never an attempt of the photo)."""
    mapped = errors.classify(streams.ERRORS, exc)
    assert isinstance(mapped, QueueUnavailableError)
    assert (mapped.reason, mapped.transient) == (reason, transient)


@pytest.mark.parametrize(("exc", "reason", "transient"), POSTGRES_FAULTS)
def test_every_postgres_fault_has_its_reason_and_kind(
    exc: Exception, reason: str, transient: bool
) -> None:
    """Failover, shutdown, conflicts and dropped connections are transient database errors;
    credentials, grants and a missing schema are permanent ones; a bad statement is a bug."""
    mapped = errors.classify(db.ERRORS, exc)
    assert mapped is not None and (mapped.reason, mapped.transient) == (reason, transient)
    expected = InternalError if reason == "sql" else DatabaseUnavailableError
    assert type(mapped) is expected


@pytest.mark.parametrize(("make", "reason", "transient"), S3_FAULTS)
def test_every_s3_fault_has_its_reason_and_kind(make: Any, reason: str, transient: bool) -> None:
    """SlowDown, RequestTimeout, 5xx, timeouts and resets are transient storage errors; a
    denial, a missing bucket, missing credentials or a skewed clock are permanent."""
    mapped = errors.classify(s3_storage._s3_rules(), make())
    assert isinstance(mapped, StorageUnavailableError)
    assert (mapped.reason, mapped.transient) == (reason, transient)


@pytest.mark.parametrize(("exc", "reason", "transient"), FILE_FAULTS)
def test_every_local_folder_fault_has_its_reason_and_kind(
    exc: OSError, reason: str, transient: bool
) -> None:
    """A busy or full folder is transient; any other I/O error (a directory where the
    original should be, no permission, a read-only disk) is permanent."""
    mapped = file_storage._file_error("reading k", exc)
    assert (mapped.reason, mapped.transient) == (reason, transient)
    assert str(mapped).startswith(f"reading k: {reason}: ")


@pytest.mark.parametrize(
    ("table", "faults"),
    [(streams.ERRORS, REDIS_FAULTS), (db.ERRORS, POSTGRES_FAULTS),
     (s3_storage._s3_rules(), S3_FAULTS), (file_storage.FILE_ERRORS, FILE_FAULTS)],
)  # fmt: skip
def test_the_fault_lists_cover_every_row_of_every_table(table: Any, faults: Any) -> None:
    """No row of an adapter's exception table goes untested: each (reason, kind) of the
    table is met by a fault above, and each fault lands on a row of the table."""
    rows = {(rule.reason, rule.transient) for rule in table}
    assert {(reason, transient) for _, reason, transient in faults} == rows


# -- Redis: real faults on a spare server --------------------------------------------------


async def test_demoted_redis_fails_the_probe_and_every_write_as_read_only(
    spare: int, spare_streams: Streams
) -> None:
    """A primary turned replica answers PING but refuses writes: the probe says read_only."""
    admin = redis.Redis(port=spare)
    admin.replicaof("127.0.0.1", free_port())  # a primary that never answers
    try:
        assert await spare_streams.client.ping()
        for call in (spare_streams.probe(), spare_streams.read_new(1, 10)):
            with pytest.raises(QueueUnavailableError) as caught:
                await call
            assert caught.value.reason == "read_only"
    finally:
        admin.replicaof("NO", "ONE")
    await spare_streams.probe()


async def test_full_or_locked_down_redis_fails_the_probe(
    spare: int, spare_streams: Streams
) -> None:
    """maxmemory reached: out_of_memory; an ACL without write rights: no_permission."""
    admin = redis.Redis(port=spare)
    admin.set("ballast", "x" * 100_000)
    admin.config_set("maxmemory", "1")
    with pytest.raises(QueueUnavailableError) as caught:
        await spare_streams.probe()
    assert caught.value.reason == "out_of_memory"
    admin.config_set("maxmemory", "0")
    admin.acl_setuser(
        "reader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@read", "+ping"]
    )
    client = redis.asyncio.Redis(port=spare, username="reader", password="pw")
    try:
        with pytest.raises(QueueUnavailableError) as caught:
            await Streams(
                client, spare_streams.stream, "darkroom", "c", spare_streams.dead_stream
            ).probe()
        assert caught.value.reason == "no_permission"
    finally:
        await client.aclose()


async def test_gate_waits_out_a_demoted_redis_with_capped_backoff_and_few_logs(
    spare: int, spare_streams: Streams
) -> None:
    """Demoted for 12 probes: the gate sleeps 0.25 s doubling to a 10 s cap, reconnects
    between probes, logs down/back and at most one 'still down' per 30 s, then reopens."""
    admin = redis.Redis(port=spare)
    admin.replicaof("127.0.0.1", free_port())
    reconnects = 0

    async def reconnect() -> None:
        nonlocal reconnects
        reconnects += 1
        await spare_streams.reconnect()

    async def promote(sleeps: int) -> None:
        if sleeps == 12:
            admin.replicaof("NO", "ONE")

    clock = FakeClock(promote)
    gate = Gate({"queue": spare_streams.probe}, {"queue": reconnect}, anyio.Event(),
                clock=clock, rand=lambda: 1.0)  # fmt: skip
    with capture_logs() as logs:
        assert await gate.wait("queue") is True
    assert clock.sleeps == [0.25, 0.5, 1, 2, 4, 8] + [10] * 6
    assert reconnects == 12 and gate.is_open()
    events = [e["event"] for e in logs]
    assert events[0] == "dependency down: pausing intake" and logs[0]["reason"] == "read_only"
    assert events[-1] == "dependency back: resuming"
    assert events.count("dependency still down") <= 3


async def test_gate_reports_the_reason_while_down_and_a_healthy_probe_returns_at_once(
    spare: int, spare_streams: Streams
) -> None:
    """While down, `down` names the dependency and reason (/readyz shows it); a dependency
    whose probe passes is not an outage at all."""
    admin = redis.Redis(port=spare)
    admin.replicaof("127.0.0.1", free_port())
    seen: dict[str, str] = {}

    async def look(sleeps: int) -> None:
        seen.update(gate.down)
        admin.replicaof("NO", "ONE")

    gate = Gate({"queue": spare_streams.probe}, {}, anyio.Event(), clock=FakeClock(look))
    assert await gate.wait("queue") is True
    assert seen["queue"].startswith("read_only: ")
    assert await gate.wait("queue") is False


async def test_readyz_masks_a_password_a_dependency_error_quotes() -> None:
    """Whatever an outage's error quotes (a URL with its password, a password= option), the
    gate's `down` (what /readyz answers) shows it masked."""
    quoted = "redis://app:sekret@10.0.0.5:6379/0 with sentinel_password=sekret"
    seen: dict[str, str] = {}
    healthy = False

    async def probe() -> None:
        if not healthy:
            raise QueueUnavailableError(f"auth: refused by {quoted}", reason="auth")

    async def look(sleeps: int) -> None:
        nonlocal healthy
        seen.update(gate.down)
        healthy = True

    gate = Gate({"queue": probe}, {}, anyio.Event(), clock=FakeClock(look))
    assert await gate.wait("queue") is True
    assert seen["queue"] == (
        "auth: refused by redis://app:***@10.0.0.5:6379/0 with sentinel_password=***"
    )


async def test_two_waiters_one_prober(spare: int, spare_streams: Streams) -> None:
    """Many photos caught in one outage: one task probes, the others wait for it."""
    admin = redis.Redis(port=spare)
    admin.replicaof("127.0.0.1", free_port())
    probes = 0

    async def probe() -> None:
        nonlocal probes
        probes += 1
        await spare_streams.probe()

    async def promote(sleeps: int) -> None:
        if sleeps == 3:
            admin.replicaof("NO", "ONE")
        await asyncio.sleep(0.05)

    gate = Gate({"queue": probe}, {}, anyio.Event(), clock=FakeClock(promote))
    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(gate.wait, "queue")
    assert probes <= 5 + 4, "waiters probe at most once each before joining the outage"
    assert gate.is_open()


async def test_a_redis_command_fails_fast_when_redis_is_down() -> None:
    """Redis unreachable: a command raises queue_unavailable (connection, transient) after one
    reconnect, well before the 5 s connect timeout: the gate and the photo's wait decide,
    not the driver."""
    client = streams.connect(f"redis://127.0.0.1:{free_port()}/0")
    try:
        started = time.monotonic()
        with pytest.raises(QueueUnavailableError) as caught:
            await _streams(client).probe()
        assert time.monotonic() - started < 4.0  # refused at once on loopback, even under load
        assert (caught.value.reason, caught.value.transient) == ("connection", True)
    finally:
        await client.aclose()


# -- Redis: ownership races ------------------------------------------------------------------


async def test_a_stale_heartbeat_or_backoff_cannot_take_back_a_reclaimed_entry() -> None:
    """A reclaimed B's entry: A's heartbeat and backoff refresh nothing and B keeps it,
    its delivery count unchanged; B's own heartbeat refreshes it."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    a = _streams(client, "a")
    b = Streams(client, a.stream, "darkroom", "b", a.dead_stream)
    try:
        await a.ensure_group()
        entry = await a.enqueue({"photo_id": str(uuid.uuid4())})
        assert [e.id for e in await a.read_new(1, 10)] == [entry]
        await client.xclaim(a.stream, "darkroom", "b", 0, [entry])  # B reclaims it
        assert await a.heartbeat([entry]) == set()
        assert await a.backoff(entry, 5_000) is False
        [row] = await client.xpending_range(a.stream, "darkroom", entry, entry, 1)
        assert (row["consumer"], row["times_delivered"]) == ("b", 2)
        assert row["time_since_delivered"] < 1_000, "A's backoff did not age B's entry"
        assert await b.heartbeat([entry]) == {entry}
        assert await b.backoff(entry, 5_000) is True
        [row] = await client.xpending_range(a.stream, "darkroom", entry, entry, 1)
        assert row["time_since_delivered"] >= 5_000 and row["times_delivered"] == 2
    finally:
        await client.delete(a.stream, a.dead_stream)
        await client.aclose()


async def test_an_entry_is_handed_back_only_by_its_holder_and_without_a_delivery() -> None:
    """B reclaimed A's entry (A lives): B hands it back to A, which owns it again with the
    same delivery count; a consumer that does not hold the entry cannot hand it anywhere."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    a = _streams(client, "a")
    b = Streams(client, a.stream, "darkroom", "b", a.dead_stream)
    try:
        await a.ensure_group()
        entry = await a.enqueue({"photo_id": str(uuid.uuid4())})
        await a.read_new(1, 10)
        await client.xclaim(a.stream, "darkroom", "b", 0, [entry])  # B reclaims it
        assert await a.hand_back(entry, "c") is False
        assert await b.hand_back(entry, "a") is True
        [row] = await client.xpending_range(a.stream, "darkroom", entry, entry, 1)
        assert (row["consumer"], row["times_delivered"]) == ("a", 2)
        assert await a.heartbeat([entry]) == {entry}, "A's heartbeat keeps it again"
    finally:
        await client.delete(a.stream, a.dead_stream)
        await client.aclose()


async def test_heartbeat_of_a_lost_group_is_a_no_op() -> None:
    """Redis restarted empty: the heartbeat refreshes nothing and raises nothing."""
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        assert await _streams(client).heartbeat(["1-0"]) == set()
    finally:
        await client.aclose()


def test_in_flight_holds_an_entry_once_and_settled_entries_leave_the_heartbeat() -> None:
    """Never one entry twice; a settled entry is not heartbeated; free places add up."""
    slots = InFlight(3)
    assert slots.admit("1-0") and slots.admit("2-0") and not slots.admit("1-0")
    assert slots.free() == 1 and slots.heartbeat_ids() == ["1-0", "2-0"]
    slots.settle("1-0")
    assert slots.heartbeat_ids() == ["2-0"] and "1-0" in slots
    slots.release("1-0")
    assert slots.free() == 2 and slots.ids() == ["2-0"]


def test_backoff_is_capped_and_the_throttle_counts_what_it_kept_quiet() -> None:
    """Delays double to the cap; a repeated failure is said once per 10 s with a count, and
    at once when it changes."""
    backoff = Backoff(0.25, 10.0, rand=lambda: 1.0)
    assert [backoff.next_s() for _ in range(8)] == [0.25, 0.5, 1, 2, 4, 8, 10, 10]
    throttle = Throttle(10.0)
    said = [throttle.allow("read_only", t / 10) for t in range(0, 250)]  # 25 s, every 0.1 s
    assert [q for q in said if q is not None] == [0, 99, 99]
    assert throttle.allow("loading", 25.0) == 49


# -- PostgreSQL: real faults -----------------------------------------------------------------


async def test_read_only_postgres_is_an_outage_and_reconnect_recovers(database_url: str) -> None:
    """default_transaction_read_only (what a failover to a reader looks like): the probe and
    every claim say read_only; after it is lifted, reconnect + probe pass."""
    name = database_url.rsplit("/", 1)[1]
    await pg_admin(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    pool = await db.connect(database_url, 2)
    try:
        for call in (probe.check(pool), leases.claim(pool, uuid.uuid4(), "1-0", "c")):
            with pytest.raises(DatabaseUnavailableError) as caught:
                await call
            assert caught.value.reason == "read_only"
        await pg_admin(f"ALTER DATABASE {name} RESET default_transaction_read_only")
        with pytest.raises(DatabaseUnavailableError):
            await probe.check(pool)  # the old sessions are still read-only
        await db.reconnect(pool)
        await probe.check(pool)
    finally:
        await pool.close()


async def test_revoked_login_and_grants_are_database_outages(database_url: str) -> None:
    """A role that may not log in: auth; one without grants on darkroom's tables:
    permission_denied, for the probe and for a claim."""
    role = f"darkroom_r_{uuid.uuid4().hex[:8]}"
    await pg_admin(f"CREATE ROLE {role} NOLOGIN")
    try:
        url = database_url.replace("postgres@", f"{role}@")
        pool = await db.connect(url, 1)
        try:
            with pytest.raises(DatabaseUnavailableError) as caught:
                await probe.check(pool)
            assert caught.value.reason == "auth"
            await pg_admin(f"ALTER ROLE {role} LOGIN")
            for call in (probe.check(pool), leases.claim(pool, uuid.uuid4(), "1-0", "c")):
                with pytest.raises(DatabaseUnavailableError) as caught:
                    await call
                assert caught.value.reason == "permission_denied"
        finally:
            await pool.close()
    finally:
        await pg_admin(f"DROP ROLE {role}")


# -- S3: denied bucket vs one denied object --------------------------------------------------


@pytest.fixture
async def denying(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[DenyingS3Proxy, Any]]:
    for key, value in AWS_ENV.items():
        monkeypatch.setenv(key, value)
    proxy = DenyingS3Proxy(s3_endpoint)
    store = await storage.open_storage(f"s3://{s3_bucket}/p", proxy.url)
    try:
        yield proxy, store
    finally:
        await store.aclose()
        proxy.close()


async def test_s3_denying_everything_is_an_outage(denying: tuple[DenyingS3Proxy, Any]) -> None:
    """Revoked credentials or a bucket policy (403 on every request): the probe fails and a
    download is storage_unavailable (access_denied), not the photo's failure."""
    proxy, store = denying
    await store.put("originals/a.jpg", b"abc", "image/jpeg")
    await store.probe()
    proxy.deny(lambda method, path: True)
    for call in (
        store.probe(),
        store.get("originals/a.jpg", 100),
        store.put("r/x", b"1", "image/webp"),
    ):
        with pytest.raises(StorageUnavailableError) as caught:
            await call
        assert caught.value.reason == "access_denied"
    proxy.deny(lambda method, path: False)
    assert await store.get("originals/a.jpg", 100) == b"abc"


async def test_s3_denying_one_object_is_that_photos_own_failure(
    denying: tuple[DenyingS3Proxy, Any],
) -> None:
    """One object under another KMS key (403 for it alone): object_forbidden, while the
    probe passes and other objects download."""
    proxy, store = denying
    await store.put("originals/a.jpg", b"abc", "image/jpeg")
    await store.put("originals/b.jpg", b"def", "image/jpeg")
    proxy.deny(lambda method, path: method == "GET" and path.endswith("/originals/b.jpg"))
    with pytest.raises(ObjectForbiddenError) as caught:
        await store.get("originals/b.jpg", 100)
    assert caught.value.code == "object_forbidden" and caught.value.stage != "storage"
    assert await store.get("originals/a.jpg", 100) == b"abc"
    await store.probe()


# -- a local folder: durability --------------------------------------------------------------


def test_a_put_is_on_disk_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FileStorage.put fsyncs the temporary file before renaming it into place, then the
    folder, and the parent of each folder it created: a publish that follows cannot point
    at a rendition a power cut took back. put_many writes every temporary file, then
    fsyncs each (one journal commit for them all), then renames them."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append((f"fsync {kind}", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "storage"
    root.mkdir()
    store = storage.FileStorage(root)
    anyio.run(store.put, "renditions/p1/thumb.webp", b"webp bytes", "image/webp")
    target = root / "renditions" / "p1" / "thumb.webp"
    assert target.read_bytes() == b"webp bytes"
    [(_, tmp)] = [e for e in events if e[0] == "fsync file"]
    assert Path(tmp).parent == target.parent and Path(tmp).name.endswith(".tmp")
    assert events == [
        ("fsync dir", str(root)),  # made renditions/
        ("fsync dir", str(root / "renditions")),  # made renditions/p1/
        ("fsync file", tmp),
        ("rename", str(target)),
        ("fsync dir", str(target.parent)),
    ]
    events.clear()
    uploads = [storage.Upload(f"renditions/p2/{n}.webp", n.encode(), "image/webp")
               for n in ("a", "b")]  # fmt: skip
    anyio.run(store.put_many, uploads)
    assert [kind for kind, _ in events] == [
        "fsync dir",  # made renditions/p2/
        "fsync file",
        "fsync file",
        "rename",
        "rename",
        "fsync dir",
    ]
    assert sorted(p.name for p in (root / "renditions" / "p2").iterdir()) == ["a.webp", "b.webp"]
    events.clear()
    anyio.run(store.put, "renditions/p1/large.webp", b"more", "image/webp")
    assert [kind for kind, _ in events] == ["fsync file", "rename", "fsync dir"]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_put_many_that_fails_midway_leaves_no_temporary_file(
    failing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fails the second fsync, or the second rename: the put fails with
    storage_unavailable, no temporary file is left and none stays open. A rename that
    fails leaves the renditions renamed before it, unreferenced (`darkroom gc` takes
    them); an fsync that fails leaves none."""
    real, calls = getattr(os, failing), []

    def flaky(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError(errno.EIO, "I/O error")
        real(*args)

    monkeypatch.setattr(os, failing, flaky)
    root = tmp_path / "storage"
    (root / "renditions").mkdir(parents=True)
    store = storage.FileStorage(root)
    uploads = [storage.Upload(f"renditions/p3/{n}.webp", n.encode(), "image/webp")
               for n in ("a", "b", "c")]  # fmt: skip
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StorageUnavailableError):
        anyio.run(store.put_many, uploads)
    left = sorted(p.name for p in (root / "renditions" / "p3").iterdir())
    assert left == ([] if failing == "fsync" else ["a.webp"])
    assert len(os.listdir("/proc/self/fd")) <= open_before


async def test_a_declared_outage_the_probe_cannot_see_goes_on_as_one_quiet_spell() -> None:
    """A grant the probe does not check: each retry fails at once as the probe passes; the
    outages are one spell (one log line, counted once), its backoff growing to 10 s."""

    async def passes() -> None:
        return None

    clock = FakeClock()
    gate = Gate({"database": passes}, {}, anyio.Event(), clock=clock, rand=lambda: 1.0)
    revoked = DatabaseUnavailableError("permission_denied: x", reason="permission_denied")
    with capture_logs() as logs:
        for _ in range(30):
            assert await gate.wait("database", revoked) is True
    said = [e["event"] for e in logs if e["log_level"] != "debug"]
    assert said[:2] == ["dependency down: pausing intake", "dependency back: resuming"]
    minutes = sum(clock.sleeps) / 60
    assert set(said[2:]) == {"dependency still down"} and len(said[2:]) <= minutes, said
    assert clock.sleeps[-1] == 10.0
