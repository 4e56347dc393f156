"""The harness of the interleaving test (tests/test_interleavings.py): in-process workers
whose jobs park before every call they make to PostgreSQL, Redis or storage until the
schedule lets them go, a stand-in renderer whose bytes name the worker, storage that
checks each delete, and a ledger of the writes PostgreSQL accepted and from whom."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import itertools
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
import redis.asyncio

from darkroom import tracing
from darkroom.errors import (
    CorruptImageError,
    DarkroomError,
    DatabaseUnavailableError,
    QueueUnavailableError,
    RenderCrashedError,
)
from darkroom.health import Gate
from darkroom.image.budget import MemoryBudget
from darkroom.image.results import Facts, Rendered, RenderResult
from darkroom.jobs import Jobs
from darkroom.queue.inflight import InFlight
from darkroom.queue.messages import Entry
from darkroom.queue.streams import Streams
from darkroom.settings import RenditionSpec, Settings
from darkroom.store import db, failures, leases, probe, publishing, upgrading
from darkroom.store.storage import FileStorage, Upload
from tests.conftest import REDIS_URL
from tests.faults import FakeClock

# A step that neither parks again nor ends within this is a hang (a lock no one frees).
STEP_TIMEOUT_S = 20.0
CHECKPOINTED = {
    "claim": leases,
    "publish": publishing,
    "record_retry": failures,
    "record_failure": failures,
    "record_rerender_failure": failures,
    "publish_upgrade": upgrading,
    "record_upgrade_failure": upgrading,
}
# Writes that end a run of the photo (each commits exactly one final event).
FINISHING = {"publish", "record_failure", "record_rerender_failure", "publish_upgrade"}

RUN: contextvars.ContextVar[Run | None] = contextvars.ContextVar("interleave_run", default=None)


def _awaiting(task: asyncio.Task[None]) -> list[str]:
    """Where a hung job waits: the chain of awaits under its task, innermost last."""
    chain, coro = [], task.get_coro()
    while coro is not None and hasattr(coro, "cr_frame"):
        if coro.cr_frame is not None:
            chain.append(f"{coro.cr_code.co_name}:{coro.cr_frame.f_lineno}")
        coro = getattr(coro, "cr_await", None)
    return chain


class Killed(BaseException):
    """The worker's process is gone (SIGKILL): nothing after this line runs, no release,
    no failure record (a BaseException: no `except Exception` of the job sees it)."""


@dataclass(eq=False)
class Run:
    """One delivery of one entry to one worker: a task that parks before each checkpoint
    (`at` names the call it waits to make) until the schedule steps it."""

    hand: Hand
    entry: Entry
    task: asyncio.Task[None] | None = None
    at: str = "start"
    free: bool = False  # the quiesce phase: runs to its end without parking
    killed: bool = False
    lose: set[str] = field(default_factory=set)  # calls whose reply is lost once
    render_error: type[DarkroomError] | None = None  # the next render fails with it
    grant: int | None = None  # the ledger's number of the claim this run holds
    _go: asyncio.Event = field(default_factory=asyncio.Event)
    _parked: asyncio.Event = field(default_factory=asyncio.Event)

    def __repr__(self) -> str:
        return f"{self.hand.name}:{self.entry.id}@{self.at}"

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    async def checkpoint(self, step: str) -> None:
        if self.free:
            return
        self.at = step
        self._parked.set()
        await self._go.wait()
        self._go.clear()
        if self.killed:
            raise Killed

    async def step(self) -> None:
        """Let the parked call go; back once the job parks at its next one, or ends."""
        self._parked.clear()
        self._go.set()
        await self.settle()

    async def settle(self) -> None:
        assert self.task is not None
        parked = asyncio.ensure_future(self._parked.wait())
        try:
            await asyncio.wait({parked, self.task}, timeout=STEP_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            parked.cancel()
        if not (self._parked.is_set() or self.task.done()):
            raise AssertionError(f"{self!r} neither parked nor ended in {STEP_TIMEOUT_S:g} s,"
                                 f" awaiting {_awaiting(self.task)}")  # fmt: skip

    async def _main(self, deliveries: int) -> None:
        RUN.set(self)
        try:
            await self.hand.jobs.handle(self.entry, deliveries)
        finally:
            if not self.killed:
                self.hand.jobs.in_flight.release(self.entry.id)


@dataclass(eq=False)
class Hand:
    """One in-process worker: its consumer name, its holder (Jobs), its in-flight runs.
    Frozen: neither stepped nor heartbeating. Dead: killed, never used again."""

    name: str
    jobs: Jobs
    ledger: Ledger
    frozen: bool = False
    dead: bool = False
    runs: list[Run] = field(default_factory=list)

    @property
    def streams(self) -> Streams:
        return self.jobs.streams

    @property
    def live(self) -> bool:
        return not self.dead and not self.frozen

    def parked(self) -> list[Run]:
        return [run for run in self.runs if not run.done]

    async def start(self, entry: Entry, deliveries: int, *, free: bool = False) -> Run | None:
        """As Worker._dispatch: never one entry twice at once in one worker. Back once the
        job parks at its first call (or, `free`, once it ends)."""
        if not self.jobs.in_flight.admit(entry.id, entry.lane):
            return None
        run = Run(self, entry, free=free)
        run.task = asyncio.create_task(run._main(deliveries))
        self.runs.append(run)
        await run.settle()
        return run

    async def kill(self) -> None:
        self.dead = True
        for run in self.parked():
            run.killed = True
            await run.step()


class StandInRenderer:
    """A render of each rendition asked for, tiny, whose bytes name the worker, count its
    renders and name the grant of the claim it renders under: two workers' renders of one
    photo differ, so they go to different keys."""

    def __init__(self, name: str) -> None:
        self.name, self.count = name, itertools.count(1)
        self.budget = MemoryBudget(1)  # the worker watches it (metrics); nothing waits here

    async def render(self, original: bytes, specs: list[RenditionSpec], **_: Any) -> RenderResult:
        run = RUN.get()
        if run is not None:
            await run.checkpoint("render")
            error, run.render_error = run.render_error, None
            if error is not None:
                raise error(f"{self.name}: render failed (scheduled)")
        made = f"{self.name}:{next(self.count)}:{len(original)}:g{run.grant if run else 0}"
        return RenderResult(Facts("jpeg", 4, 3), [_stand_in(made, spec) for spec in specs])

    async def __aenter__(self) -> StandInRenderer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def _stand_in(made: str, spec: RenditionSpec) -> Rendered:
    data = f"{made}:{spec.format}".encode()
    return Rendered(spec.name, spec.format, spec.ext, 4, 3, data, hashlib.sha256(data).hexdigest())


REFERENCED_SQL = """
SELECT count(*) FROM photos p, jsonb_array_elements(p.renditions) r WHERE r->>'key' = $1
"""


class WatchedStorage(FileStorage):
    """The one storage of every worker: downloads and uploads are checkpoints, and a
    delete of a key that a committed row references at that moment is recorded."""

    def __init__(self, root: Path, pool: db.Pool, ledger: Ledger) -> None:
        super().__init__(root)
        self.pool, self.ledger = pool, ledger

    async def get(self, key: str, max_bytes: int) -> bytes:
        if (run := RUN.get()) is not None:
            await run.checkpoint("download")
        return await super().get(key, max_bytes)

    async def put_many(self, objects: list[Upload], cache_control: str | None = None) -> None:
        if (run := RUN.get()) is not None:
            await run.checkpoint("upload")
        await super().put_many(objects, cache_control)

    async def delete(self, key: str) -> None:
        # no checkpoint: deletes run under the photo's row lock (a parked holder of a row
        # lock would hang every other statement on the photo, not interleave with it)
        if await self.pool.fetchval(REFERENCED_SQL, key):
            self.ledger.wrong.append(f"deleted {key} while a row references it")
        self.ledger.deleted.add(key)
        await super().delete(key)


@dataclass
class Ledger:
    """What PostgreSQL accepted, from whom: claims in grant order (the fencing tokens the
    harness hands out itself), finishing writes per photo, and every breach seen."""

    grants: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    clock: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    finished: dict[uuid.UUID, list[tuple[int | None, str]]] = field(default_factory=dict)
    requested: dict[uuid.UUID, int] = field(default_factory=dict)  # last re-render request
    granted_at: dict[int, int] = field(default_factory=dict)  # grant → its time
    deleted: set[str] = field(default_factory=set)
    wrong: list[str] = field(default_factory=list)

    def now(self) -> int:
        return next(self.clock)

    def grant(self, run: Run, claim: leases.Claim) -> None:
        own = claim.outcome == "claimed" and not claim.counted and run.grant is not None
        if claim.outcome in ("claimed", "exhausted") and not own:
            run.grant = next(self.grants)
            self.granted_at[run.grant] = self.now()

    def accepted(self, run: Run, call: str, photo_id: uuid.UUID, job: Any, token: int) -> None:
        """`job`: the photo's job row as the write found it (read just before it); `token`:
        the fencing token the write carried, which must be the job's newest."""
        current = job is not None and (
            job["holder"], job["state"], job["lease_token"]) == (
            run.hand.jobs.holder, "active", token)  # fmt: skip
        if not current:
            held = dict(job) if job is not None else None
            self.wrong.append(f"{call} of {photo_id} accepted from {run!r} (grant {run.grant}),"
                              f" not the current claim: {held}")  # fmt: skip
        if call not in FINISHING:
            return
        done = self.finished.setdefault(photo_id, [])
        if any(grant == run.grant for grant, _ in done):
            self.wrong.append(f"{photo_id}: grant {run.grant} finished twice ({call} by {run!r})")
        done.append((run.grant, call))


JOB_SQL = "SELECT holder, stream_entry, state, lease_token FROM photo_jobs WHERE photo_id = $1"


def accepted_by(call: str, result: Any) -> bool:
    if call == "publish":
        return bool(result.status == "published")
    if call == "record_failure":
        return bool(result == "failed")
    if call in ("record_rerender_failure", "record_upgrade_failure"):
        return bool(result != "not_recorded")
    if call == "publish_upgrade":
        return bool(result.status == "upgraded")
    return bool(result)


def token_of(call: str, args: tuple[Any, ...]) -> int:
    """The fencing token a write carries: a publish's (token, entry) lease, else its first
    argument after the photo."""
    if call in ("publish", "publish_upgrade"):
        return int(args[2 if call == "publish" else 1][0])
    return int(args[0])


def checkpointed(call: str, real: Callable[..., Awaitable[Any]]) -> Any:
    """`db.<call>` as a job makes it: parks first; then the call commits, the ledger
    records what it accepted, and a lost reply (armed on the run) raises after the commit."""

    async def call_(pool: db.Pool, photo_id: uuid.UUID, *args: Any, **kwargs: Any) -> Any:
        run = RUN.get()
        if run is None:
            return await real(pool, photo_id, *args, **kwargs)
        await run.checkpoint(call)
        job = await pool.fetchrow(JOB_SQL, photo_id)
        result = await real(pool, photo_id, *args, **kwargs)
        if call == "claim":
            run.hand.ledger.grant(run, result)
        elif accepted_by(call, result):
            run.hand.ledger.accepted(run, call, photo_id, job, token_of(call, args))
        if call in run.lose:
            run.lose.discard(call)
            raise DatabaseUnavailableError("reply lost after commit", reason="connection",
                                           transient=True)  # fmt: skip
        return result

    return call_


def redis_checkpointed(call: str, real: Callable[..., Awaitable[Any]]) -> Any:
    """`Streams.<call>` (ack, dead_letter, backoff): parks first; a lost reply raises
    after Redis ran it."""

    async def call_(self: Streams, *args: Any) -> Any:
        run = RUN.get()
        if run is None:
            return await real(self, *args)
        await run.checkpoint(call)
        result = await real(self, *args)
        if call in run.lose:
            run.lose.discard(call)
            raise QueueUnavailableError("reply lost", reason="connection", transient=True)
        return result

    return call_


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints on every call of a job to PostgreSQL and Redis (storage and render
    have theirs in WatchedStorage and StandInRenderer); outside a run they pass through.
    Every delivery is traced: its claim (and a row written whole at its end) keeps a span
    id of its own, as a traced worker's in a sampled trace, for the late writer's pass
    (tests/interleave_spans.py); no span is exported (tracing stays off)."""
    monkeypatch.setattr(tracing, "delivery_span_id", lambda: secrets.token_hex(8))
    for call, module in CHECKPOINTED.items():
        monkeypatch.setattr(module, call, checkpointed(call, getattr(module, call)))
    for call in ("ack", "dead_letter", "backoff"):
        monkeypatch.setattr(Streams, call, redis_checkpointed(call, getattr(Streams, call)))


RENDER_ERRORS: dict[str, type[DarkroomError]] = {
    "corrupt": CorruptImageError,  # the photo's own fault: dead-lettered at once
    "crashed": RenderCrashedError,  # retried later, up to DARKROOM_MAX_ATTEMPTS
}


def hand(
    name: str, settings: Settings, pool: db.Pool, streams: Streams, storage: FileStorage,
    ledger: Ledger,
) -> Hand:  # fmt: skip
    """A worker's Jobs, as Worker builds them, with a fake clock (waits in place are
    instant) and the stand-in renderer."""
    mine = Streams(streams.client, streams.stream, streams.group, name, streams.dead_stream)
    gate = Gate({"database": lambda: probe.check(pool), "queue": mine.probe,
                 "storage": storage.probe}, {}, anyio.Event(), clock=FakeClock())  # fmt: skip
    renderer: Any = StandInRenderer(name)
    jobs = Jobs(settings, pool, mine, storage, gate, renderer, anyio.Event(), InFlight(4))
    return Hand(name, jobs, ledger)


class Rig:
    """What every schedule shares: one loop, one pool, one Redis client, one database
    (emptied at each schedule's start)."""

    def __init__(self, runner: asyncio.Runner, database_url: str) -> None:
        self.runner, self.database_url = runner, database_url
        # what a crash would lose is not under test here: commits need not wait for the disk
        runner.run(_admin(database_url, "ALTER DATABASE {} SET synchronous_commit = off"))
        self.pool: db.Pool = runner.run(db.connect(database_url, 8))
        self.client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    def close(self) -> None:
        self.run(self.client.aclose())
        self.run(self.pool.close())


async def _admin(database_url: str, sql: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(sql.format(database_url.rsplit("/", 1)[1]))
    finally:
        await conn.close()
