"""One render process, from the inside: it sets its own limits, says it is ready, then
renders the photos the pool sends down its pipe one at a time and answers each with the
result, or the error, and its memory figures, until the pool closes the pipe.

It runs in a child of the forkserver (image/renderer.py starts it), which has imported only
this module and what it needs: libvips, numpy and the pipeline; no event loop, no anyio.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pyvips

from darkroom.errors import CorruptImageError, DarkroomError, RenderOutOfMemoryError
from darkroom.image.pipeline import render
from darkroom.image.stagetimes import Stages

_M_ARENA_MAX = -8  # glibc mallopt parameter
# A process whose address space came this close to its limit is not given another photo
# (renderer.py retires it): the next allocation failure could not be told from bad data.
MEMORY_MARGIN_MB = 64
# A new render process's first word, once its niceness, arenas, threads and memory limit are
# set: the pool hands it no photo, and counts it warm, before that.
READY = "ready"
# Asked instead of a photo: return freed memory to the system now, answered like a photo
# ("trimmed"). After a photo took the whole memory budget, the pool asks each other process
# before its next photo, so what it kept (up to keep_mb) is not resident beside that decode.
TRIM = "trim"
# A render process returns its freed memory to the system after a photo only when it holds
# more than `keep_mb` (DARKROOM_RENDER_KEEP_MB) then, and whenever it had no photo for
# IDLE_TRIM_S. Not after every photo: under load the next photo reuses the freed heap, and
# giving it back each time cost a 12 MP JPEG ~6,000 page faults and ~27 ms of system time
# (docs/architecture.md, "Freed memory kept for the next photo").
IDLE_TRIM_S = 0.5
_LIBC = ctypes.CDLL(None)


def serve(conn: Connection, memory_mb: int, keep_mb: int, vips_threads: int, nice: int = 0) -> None:
    """Render requests one at a time until the pool closes the pipe (EOF) or memory ran out."""
    # Ctrl-C reaches the whole process group; only the worker decides when a render stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if nice:
        os.nice(nice)
    # Two malloc arenas: far less reserved address space, so the limit measures real use.
    _LIBC.mallopt(_M_ARENA_MAX, 2)
    pyvips.concurrency_set(vips_threads)
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with conn:
        conn.send(READY)
        peak_mb = _status_mb("VmPeak")
        while True:
            if not conn.poll(IDLE_TRIM_S):
                _LIBC.malloc_trim(0)  # idle: freed memory goes back to the system
            reply = _serve_one(conn, memory_mb, peak_mb)
            if reply is None:
                return
            kind, value, memory = reply
            # VmPeak never goes down: the pool retires a process whose peak neared the
            # limit (see _retirement)
            rss_mb = _kept_rss_mb(memory["VmRSS"], keep_mb)
            conn.send((kind, value, rss_mb, memory["VmPeak"]))
            if isinstance(value, RenderOutOfMemoryError):
                return  # the pipe may be out of step after a failed allocation: retire
            del reply, value  # not the next photo's memory, nor the idle trim's
            peak_mb = _status_mb("VmPeak")  # the next photo's "before", its reply sent


def call(conn: Connection, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run one function in this fresh process and send back what it returned."""
    with conn:
        conn.send(function(*args))


Served = tuple[str, Any, dict[str, int]]


def _serve_one(conn: Connection, memory_mb: int, peak_before: int) -> Served | None:
    """One photo: ("ok", result) or ("error", exc), and this process's memory once the
    photo's pixels and original are gone (one read of /proc/self/status a photo)."""
    _reset_peak()
    request: Any = None
    value: Any
    try:
        request = conn.recv()
        if request == TRIM:
            _LIBC.malloc_trim(0)
            return "trimmed", None, _status_mbs("VmHWM", "VmRSS", "VmPeak")
        data, specs, max_pixels, time_stages = request
        # a traced photo's stages are timed here for the worker's spans (it has the context)
        kind, value = "ok", render(data, specs, max_pixels, Stages(time_stages))
    except EOFError:
        return None
    except (MemoryError, DarkroomError) as exc:
        # without its traceback: it would hold this frame (the original, the pixels) in a
        # cycle with `value`, freed only by the garbage collector; pickling drops it anyway
        kind, value = "error", exc.with_traceback(None)
    request = None  # the original is not the memory this photo keeps
    memory = _status_mbs("VmHWM", "VmRSS", "VmPeak")
    if kind == "ok":
        return kind, msgspec.structs.replace(value, peak_rss_mb=memory["VmHWM"]), memory
    if _out_of_memory(value, memory["VmPeak"], peak_before, memory_mb):
        return kind, RenderOutOfMemoryError(f"render needed more than {memory_mb} MB"), memory
    return kind, value, memory


def _out_of_memory(exc: Exception, peak: int, peak_before: int, memory_mb: int) -> bool:
    """libvips reports a failed allocation as a generic error: if this photo pushed the
    address space up to the limit, it is memory."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, CorruptImageError) and (
        _says_out_of_memory(exc) or (peak > peak_before and peak >= memory_mb - MEMORY_MARGIN_MB)
    )


# libvips' words for an allocation or thread start refused under RLIMIT_AS
_OUT_OF_MEMORY_WORDS = ("failed to allocate", "error creating thread", "out of memory",
                        "cannot allocate memory")  # fmt: skip


def _says_out_of_memory(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(words in text for words in _OUT_OF_MEMORY_WORDS)


def _reset_peak() -> None:
    """Reset VmHWM so each photo reports its own peak resident memory (Linux ≥ 4.0)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _status_mb(field: str) -> int:
    """One memory figure of this process from /proc/self/status (VmPeak, VmHWM...), in MB."""
    return _status_mbs(field)[field]


def _status_mbs(*fields: str) -> dict[str, int]:
    """Memory figures of this process from one read of /proc/self/status, in MB (a figure
    the kernel does not show: the peak as getrusage knows it)."""
    with open("/proc/self/status") as status:
        text = status.read()
    found = {}
    for name in fields:
        at = text.find(f"\n{name}:")
        found[name] = (
            int(text[at:].split(maxsplit=2)[1]) // 1024
            if at >= 0
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        )
    return found


def _kept_rss_mb(rss_mb: int, keep_mb: int) -> int:
    """Resident memory once a photo's pixels are freed; over `keep_mb`, once the freed
    memory is returned to the system too (what stays then is what the process holds)."""
    if rss_mb <= keep_mb:
        return rss_mb
    _LIBC.malloc_trim(0)
    return _status_mb("VmRSS")
