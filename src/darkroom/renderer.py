"""Runs the libvips pipeline off the event loop, in child processes that can be killed.

A hard wall-clock limit (DARKROOM_JOB_TIMEOUT_S) kills the child; an address-space
limit (DARKROOM_RENDER_MEMORY_MB) makes allocations fail inside it; a native crash
ends only that child. Each becomes a stable error code for that one photo.
"""

from __future__ import annotations

import ctypes
import resource
import signal
from collections.abc import Sequence

import anyio
from anyio import CapacityLimiter, to_process

from darkroom.errors import (
    CorruptImageError,
    RenderCrashedError,
    RenderOutOfMemoryError,
    RenderTimeoutError,
)
from darkroom.pipeline import RenderResult, render
from darkroom.settings import RenditionSpec

_configured_memory_mb = 0
_M_ARENA_MAX = -8  # glibc mallopt parameter


def _configure_child(memory_mb: int) -> None:
    global _configured_memory_mb
    if _configured_memory_mb == memory_mb:
        return
    # Ctrl-C reaches the whole process group; only the worker decides when a render stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Two malloc arenas: far less reserved address space (so the limit measures real use)
    # and less fragmentation over thousands of photos.
    ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 2)
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _configured_memory_mb = memory_mb


def render_in_child(
    data: bytes, specs: Sequence[RenditionSpec], max_pixels: int, memory_mb: int
) -> RenderResult:
    _configure_child(memory_mb)
    try:
        return render(data, specs, max_pixels)
    except (MemoryError, CorruptImageError) as exc:
        # libvips reports a failed allocation as a generic error: near the limit, it is memory.
        if isinstance(exc, MemoryError) or _peak_mb() >= memory_mb - _MEMORY_MARGIN_MB:
            raise RenderOutOfMemoryError(f"render needed more than {memory_mb} MB") from None
        raise


_MEMORY_MARGIN_MB = 64


def _peak_mb() -> int:
    """Peak address space of this process (VmPeak), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) // 1024
    return 0


async def render_isolated(
    data: bytes,
    specs: Sequence[RenditionSpec],
    *,
    max_pixels: int,
    timeout_s: float,
    memory_mb: int,
    limiter: CapacityLimiter,
) -> RenderResult:
    try:
        with anyio.fail_after(timeout_s):
            return await to_process.run_sync(
                render_in_child,
                data,
                specs,
                max_pixels,
                memory_mb,
                cancellable=True,
                limiter=limiter,
            )
    except TimeoutError:
        raise RenderTimeoutError(f"render took longer than {timeout_s:g} s") from None
    except anyio.BrokenWorkerProcess as exc:
        raise RenderCrashedError(f"render process died: {exc}") from None
