"""The render slots: a pool of warm, isolated render processes that run the libvips pipeline.

`RenderPool` owns every render slot (`DARKROOM_CONCURRENCY`, plus the
`DARKROOM_INTERACTIVE_SLOTS` only interactive photos may use): one long-lived process per
slot, forked from a forkserver that has already imported libvips, rendering one photo at a
time. Like a prefork pool (Celery's max_tasks_per_child / max_memory_per_child, gunicorn's
max_requests), a process is retired after `renders_per_process` photos or when its resident
memory after a photo, freed memory returned, passes `max_rss_mb`; it is killed at once on a
timeout, a cancelled render, a crash or an out-of-memory failure. So `timeout`, `out_of_memory` and
`render_crashed` still cost only their photo, each process keeps its address-space limit,
and memory cannot creep: every process is young and bounded. Across the slots, a render
starts only when its estimated decode memory fits `DARKROOM_RENDER_BUDGET_MB` beside the
renders running (budget.py, footprint.py): two very large decodes never run at once. What
runs inside a process is renderproc.py; the pipe between them, on the worker's side, is
pipe.py; the free slots are slots.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import anyio

from darkroom.errors import (
    DarkroomError,
    RenderCrashedError,
    RenderOutOfMemoryError,
    RenderTimeoutError,
)
from darkroom.image import footprint, forking, pipe, renderproc
from darkroom.image.budget import MemoryBudget
from darkroom.image.results import RenderResult
from darkroom.image.slots import REGULAR_NICE, Slots
from darkroom.settings import RenditionSpec, Settings

_CLOSE_WAIT_S = 5.0
_READY_WAIT_S = 30.0


def vips_threads_for(slots: int) -> int:
    """libvips threads per render process, so processes × threads fits the usable cores."""
    return max(1, len(os.sched_getaffinity(0)) // slots)


# -- the pool ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Child:
    """One render process and the parent's end of its pipe."""

    process: Any
    conn: Connection
    renders: int = 0
    kind: str = "regular"  # the slot it serves: "regular" or "reserved"
    trimmed: int = 0  # the pool's _trim_generation when it last returned its kept memory
    trimming: anyio.Event | None = None  # set when an idle trim's answer came

    async def exchange(
        self, request: tuple[bytes, tuple[RenditionSpec, ...], int]
    ) -> tuple[Any, ...]:
        """Send one photo and wait for its reply on the event loop (image/pipe.py);
        ("died",), the pipe closed, if the process went away."""
        try:
            await pipe.send(self.conn.fileno(), request)
            return await pipe.recv(self.conn.fileno())  # type: ignore[no-any-return]
        except (EOFError, OSError):
            self.conn.close()
            return ("died",)

    def ready(self) -> bool:
        """Runs in a thread: wait for the process's first word (it is set up); False if it
        died or hung first. Once ready, the pipe is the event loop's (non-blocking)."""
        try:
            if not (self.conn.poll(_READY_WAIT_S) and self.conn.recv() == renderproc.READY):
                return False
        except (EOFError, OSError):
            return False
        os.set_blocking(self.conn.fileno(), False)
        return True


class RenderPool:
    """`async with RenderPool(...) as pool: await pool.render(data, specs)`.

    At most `slots` renders run at once, and only as many as their estimated decode memory
    fits `budget_mb`; a caller waits for a free slot, then for the budget. The pool starts its
    processes on entry and lazily after a retirement, and closes them all on exit.
    """

    def __init__(
        self,
        slots: int,
        *,
        max_pixels: int,
        timeout_s: float,
        memory_mb: int,
        renders_per_process: int,
        max_rss_mb: int,
        keep_mb: int,
        vips_threads: int | None = None,
        reserved: int = 0,
        budget_mb: int | None = None,
    ) -> None:
        self.slots = slots + reserved  # one warm process per slot, reserved ones included
        self.max_pixels = max_pixels
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.renders_per_process = renders_per_process
        self.max_rss_mb = max_rss_mb
        # kept under load; never more than the bound a process is retired over
        self.keep_mb = min(keep_mb, max_rss_mb)
        # Sized for the regular slots: a reserved slot is idle most of the time, and bulk
        # alone must not lose threads to it (an upload's render briefly oversubscribes).
        self.vips_threads = vips_threads or vips_threads_for(slots)
        self.started = 0  # processes started, for tests and the benchmark
        self.trims = 0  # processes asked to return their kept memory (_trimmed)
        self._trim_generation = 0  # photos that took the whole budget
        self.retired: Counter[str] = Counter()  # why processes ended
        self._free = Slots(slots, reserved)
        # decode memory shared by all slots (image/budget.py); None: as much as all slots use
        self.budget = MemoryBudget(budget_mb if budget_mb is not None else 2**31)
        self._nice = {"regular": REGULAR_NICE if reserved else 0, "reserved": 0}
        self._sizes = {"regular": slots, "reserved": reserved}
        self._idle: list[_Child] = []
        self._closed = False
        self._threads = anyio.CapacityLimiter(self.slots)  # starts and joins, off anyio's pool

    @classmethod
    def from_settings(cls, settings: Settings) -> RenderPool:
        return cls(
            settings.concurrency,
            max_pixels=settings.max_pixels,
            timeout_s=settings.job_timeout_s,
            memory_mb=settings.render_memory_mb,
            renders_per_process=settings.renders_per_process,
            max_rss_mb=settings.render_max_rss_mb,
            keep_mb=settings.render_keep_mb,
            reserved=settings.interactive_slots,
            budget_mb=settings.render_budget_total_mb,
        )

    async def __aenter__(self) -> RenderPool:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Warm every slot now, so the first photos pay no process start: each process is
        set up (its niceness too) when this returns."""
        for kind, size in self._sizes.items():
            while sum(child.kind == kind for child in self._idle) < size:
                self._idle.append(await self._spawn(kind))

    async def close(self) -> None:
        """End the idle processes: EOF asks them to exit, a kill ends the ones that do not."""
        self._closed = True
        idle, self._idle = self._idle, []
        with anyio.CancelScope(shield=True):
            for child in idle:
                child.conn.close()
                await self._reap(child, "closed", timeout_s=_CLOSE_WAIT_S)

    def pids(self) -> list[int]:
        """Process ids of the idle render processes (for tests and the benchmark)."""
        return [child.process.pid for child in self._idle]

    async def render(
        self,
        data: bytes,
        specs: Sequence[RenditionSpec],
        *,
        interactive: bool = False,
        started: Callable[[], object] | None = None,
        time_stages: bool = False,
    ) -> RenderResult:
        """Render in a warm process; raises the render's DarkroomError, or timeout, crash
        and out-of-memory codes. A cancelled render kills and reaps its process.
        `interactive` may use a reserved slot. Once it holds a slot, the photo waits until its
        estimated decode memory fits the budget; `started` is called when it is admitted.
        Neither wait counts towards `timeout_s`: that bounds the render alone. `time_stages` (the
        worker's render span records) has the process time its stages into the result."""
        async with self._slot(interactive) as kind, self._memory(data, interactive) as mb:
            if started is not None:
                started()
            child = self._take_idle(kind) or await self._spawn(kind)
            if child.trimming is not None:  # the idle trim below, under way: the pipe is its
                with anyio.CancelScope(shield=True):  # brief; a cancel then ends the render
                    await child.trimming.wait()
            if mb >= self.budget.total_mb:  # alone: the other processes are to trim first
                self._trim_generation += 1
                child.trimmed = self._trim_generation
                await self._trim_idle()
            elif child.trimmed < self._trim_generation:
                child = await self._trimmed(child, kind)
            request = (data, tuple(specs), self.max_pixels, time_stages)
            reply = await self._exchange(child, request)
            if reply[0] == "died":
                await self._reap(child, "crashed", timeout_s=_CLOSE_WAIT_S)
                raise _death(child.process.exitcode, self.memory_mb)
            kind, value, rss_mb, peak_mb = reply
            await self._keep_or_retire(child, value, rss_mb, peak_mb)
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def _slot(self, interactive: bool) -> AsyncIterator[str]:
        kind = await self._free.acquire(interactive)
        try:
            yield kind
        finally:
            self._free.release(kind, interactive)

    @contextlib.asynccontextmanager
    async def _memory(self, data: bytes, interactive: bool) -> AsyncIterator[int]:
        mb = await self.budget.take(footprint.estimate_mb(data), interactive)
        try:
            yield mb
        finally:
            self.budget.give_back(mb)

    async def _trim_idle(self) -> None:
        """Each idle process returns what it kept now, staying idle: a render that takes one
        meanwhile waits for its trim's answer before it sends its photo."""
        for child in list(self._idle):
            if child not in self._idle:  # a render took it meanwhile: its pipe is that photo's
                continue
            child.trimmed, child.trimming = self._trim_generation, anyio.Event()
            try:
                reply = await self._exchange(child, renderproc.TRIM)  # a cancel kills it
            finally:
                child.trimming.set()
                child.trimming = None
                # died or killed: out of _idle (a render that took it reaps it itself)
                gone = child.conn.closed and child in self._idle
                if gone:
                    self._idle.remove(child)
            self.trims += reply[0] != "died"
            if gone:
                await self._reap(child, "crashed", timeout_s=_CLOSE_WAIT_S)

    async def _trimmed(self, child: _Child, kind: str) -> _Child:
        """The process, once it returned what it kept (a photo took the whole budget since its
        last photo, and may still be decoding); one that died is replaced."""
        child.trimmed = self._trim_generation
        if (await self._exchange(child, renderproc.TRIM))[0] != "died":
            self.trims += 1
            return child
        await self._reap(child, "crashed", timeout_s=_CLOSE_WAIT_S)
        return await self._spawn(kind)

    def _take_idle(self, kind: str) -> _Child | None:
        for i in range(len(self._idle) - 1, -1, -1):
            if self._idle[i].kind == kind:
                return self._idle.pop(i)
        return None

    async def _exchange(self, child: _Child, request: Any) -> tuple[Any, ...]:
        done = False
        try:
            with anyio.fail_after(self.timeout_s):
                reply = await child.exchange(request)
            done = True
            return reply
        except TimeoutError:
            raise RenderTimeoutError(f"render took longer than {self.timeout_s:g} s") from None
        finally:
            if not done:  # timed out or cancelled: the process may be mid-photo
                if child.process.exitcode is None:
                    child.process.kill()
                child.conn.close()
                await self._reap(child, "killed")

    async def _keep_or_retire(self, child: _Child, value: Any, rss_mb: int, peak_mb: int) -> None:
        child.renders += 1
        reason = self._retirement(child, value, rss_mb, peak_mb)
        if reason is None:
            self._idle.append(child)
        else:  # EOF asks it to exit; one that does not is killed
            child.conn.close()
            await self._reap(child, reason, timeout_s=_CLOSE_WAIT_S)

    def _retirement(self, child: _Child, value: Any, rss_mb: int, peak_mb: int) -> str | None:
        if isinstance(value, RenderOutOfMemoryError):
            return "out_of_memory"
        if peak_mb >= self.memory_mb - renderproc.MEMORY_MARGIN_MB:
            # its address space once came near the limit: the next photo's allocation
            # failure could no longer be told from a corrupt image
            return "address_space"
        if self._closed:
            return "closed"
        if child.renders >= self.renders_per_process:
            return "renders"
        return "rss" if rss_mb > self.max_rss_mb else None

    async def _spawn(self, kind: str = "regular") -> _Child:
        ctx = forking.forkserver()
        ours, theirs = ctx.Pipe(duplex=True)
        args = (theirs, self.memory_mb, self.keep_mb, self.vips_threads, self._nice[kind])
        process = ctx.Process(target=renderproc.serve, args=args, daemon=True)
        try:
            await anyio.to_thread.run_sync(forking.start, process, limiter=self._threads)
        finally:
            theirs.close()  # before the wait: a child that dies is then an EOF here
        self.started += 1
        child = _Child(process, ours, kind=kind, trimmed=self._trim_generation)
        try:
            ready = await anyio.to_thread.run_sync(child.ready, limiter=self._threads)
        except BaseException:  # cancelled while it started: not left running
            ours.close()
            await self._reap(child, "closed", timeout_s=0)
            raise
        if not ready:
            ours.close()
            await self._reap(child, "crashed", timeout_s=0)
            raise RenderCrashedError(f"render process did not start (exit {process.exitcode})")
        return child

    async def _reap(self, child: _Child, reason: str, *, timeout_s: float | None = None) -> None:
        """Wait for the process to end (killing it after `timeout_s`), even when cancelled."""
        process = child.process
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(process.join, timeout_s, limiter=self._threads)
            if process.exitcode is None:
                process.kill()
                await anyio.to_thread.run_sync(process.join, limiter=self._threads)
        self.retired[reason] += 1


def _death(exitcode: int | None, memory_mb: int) -> DarkroomError:
    if exitcode == -signal.SIGKILL:
        return RenderOutOfMemoryError(f"render process was killed (SIGKILL; limit {memory_mb} MB)")
    name = signal.Signals(-exitcode).name if exitcode and exitcode < 0 else f"exit {exitcode}"
    return RenderCrashedError(f"render process died ({name})")
