"""Runs the libvips pipeline off the event loop, one fresh child process per photo.

Children fork from a forkserver that has already imported libvips, so starting one costs
milliseconds. A fresh process per photo means a hard wall-clock limit (the child is
killed: `timeout`), an address-space limit (`out_of_memory`), a native crash that costs
only that photo (`render_crashed`), and memory that cannot creep over thousands of photos.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import resource
import signal
import threading
from collections.abc import Sequence
from multiprocessing import spawn
from multiprocessing.connection import Connection
from typing import Any

import anyio
import msgspec
from anyio import CapacityLimiter

from darkroom.errors import (
    CorruptImageError,
    DarkroomError,
    RenderCrashedError,
    RenderOutOfMemoryError,
    RenderTimeoutError,
)
from darkroom.pipeline import RenderResult, render
from darkroom.settings import RenditionSpec

_M_ARENA_MAX = -8  # glibc mallopt parameter
_MEMORY_MARGIN_MB = 64
_context: Any = None
_START_LOCK = threading.Lock()


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["darkroom.renderer"])
    return _context


def _start(process: Any) -> None:
    """Start a child without re-running the parent's main module in it.

    multiprocessing re-imports `__main__` in every child (CPython 3.11's forkserver cannot
    preload it), which costs ~150 ms of imports per photo; the target lives in this module,
    so the child needs none of it.
    """
    with _START_LOCK:
        original = spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            process.start()
        finally:
            spawn.get_preparation_data = original


def _child_main(
    out: Connection, data: bytes, specs: Sequence[RenditionSpec], max_pixels: int, memory_mb: int
) -> None:
    # Ctrl-C reaches the whole process group; only the worker decides when a render stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Two malloc arenas: far less reserved address space, so the limit measures real use.
    ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 2)
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = render(data, specs, max_pixels)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        out.send(("ok", msgspec.structs.replace(result, peak_rss_mb=peak_mb)))
    except (MemoryError, CorruptImageError) as exc:
        # libvips reports a failed allocation as a generic error: near the limit, it is memory.
        if isinstance(exc, MemoryError) or _peak_mb() >= memory_mb - _MEMORY_MARGIN_MB:
            out.send(("error", RenderOutOfMemoryError(f"render needed more than {memory_mb} MB")))
        else:
            out.send(("error", exc))
    except DarkroomError as exc:
        out.send(("error", exc))
    finally:
        out.close()


def _peak_mb() -> int:
    """Peak address space of this process (VmPeak), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) // 1024
    return 0


def _receive(conn: Connection, process: Any) -> tuple[str, Any]:
    try:
        return conn.recv()  # type: ignore[no-any-return]
    except EOFError:
        process.join()
        return "died", process.exitcode


def _death(exitcode: int | None, memory_mb: int) -> DarkroomError:
    if exitcode == -signal.SIGKILL:
        return RenderOutOfMemoryError(f"render process was killed (SIGKILL; limit {memory_mb} MB)")
    name = signal.Signals(-exitcode).name if exitcode and exitcode < 0 else f"exit {exitcode}"
    return RenderCrashedError(f"render process died ({name})")


async def render_isolated(
    data: bytes,
    specs: Sequence[RenditionSpec],
    *,
    max_pixels: int,
    timeout_s: float,
    memory_mb: int,
    limiter: CapacityLimiter,
) -> RenderResult:
    """Render in a new child; raises the child's DarkroomError or timeout/crash/OOM codes."""
    async with limiter:
        ctx = _forkserver()
        receiver, sender = ctx.Pipe(duplex=False)
        # Its own thread token: a render waiting on its child must not take one of anyio's
        # shared worker threads (40 by default) from file I/O or other renders.
        threads = anyio.CapacityLimiter(1)
        process = ctx.Process(
            target=_child_main, args=(sender, data, tuple(specs), max_pixels, memory_mb)
        )
        try:
            await anyio.to_thread.run_sync(_start, process, limiter=threads)
            sender.close()
            with anyio.fail_after(timeout_s):
                kind, value = await anyio.to_thread.run_sync(
                    _receive, receiver, process, abandon_on_cancel=True, limiter=threads
                )
        except TimeoutError:
            raise RenderTimeoutError(f"render took longer than {timeout_s:g} s") from None
        finally:
            if process.is_alive():
                process.kill()
            await anyio.to_thread.run_sync(process.join, limiter=threads)
            receiver.close()
    if kind == "ok":
        return value  # type: ignore[no-any-return]
    if kind == "error":
        raise value
    raise _death(value, memory_mb)
