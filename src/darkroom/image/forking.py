"""The render processes' origin: a forkserver that has imported libvips and the pipeline once
(`renderproc`, its preload), children started from it without re-importing the parent's
main module, and `isolated` for one-off work in such a child (the start-up self-check).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing import spawn
from typing import Any

from darkroom.errors import RenderCrashedError
from darkroom.image import renderproc

_START_LOCK = threading.Lock()
_context: Any = None
_START_LOCK = threading.Lock()


def forkserver() -> Any:
    global _context
    if _context is None:
        # numpy's OpenBLAS and LibRaw's OpenMP start a thread per CPU, each reserving address
        # space under the render's limit: one each, the slots are the parallelism
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["darkroom.image.renderproc"])
    return _context


def start(process: Any) -> None:
    """Start a child without re-running the parent's main module in it.

    multiprocessing re-imports `__main__` in every child (CPython 3.11's forkserver cannot
    preload it), which costs ~150 ms of imports per process; the target lives in this
    module's sibling renderproc.py, so the child needs none of it.
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


def isolated(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a child of the forkserver, for one-off libvips work whose decoders
    and freed memory the caller should not keep (the start-up self-check); raises
    RenderCrashedError if the child died first."""
    ours, theirs = forkserver().Pipe(duplex=False)
    process = forkserver().Process(target=renderproc.call, args=(theirs, function, args))
    start(process)
    theirs.close()
    try:
        with ours:
            return ours.recv()
    except EOFError:
        raise RenderCrashedError("isolated process died") from None
    finally:
        process.join()
