"""The strongest bare baseline: a pyvips loop with darkroom's encoder settings and nothing else.

Each photo is decoded once (shrink-on-load to the largest rendition) and the same renditions
are cascaded from it with the same save options as pipeline.py: no facts, no ThumbHash, no
checks, no queue. `best_layout` tries every thread layout below on the same files, each at
steady state (its processes and threads warmed first, then timed over `passes` passes), and
keeps the fastest, so a ratio against it never carries darkroom's own costs.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyvips

from darkroom.settings import DEFAULT_RENDITIONS, parse_renditions

ORDERED = sorted(parse_renditions(DEFAULT_RENDITIONS), key=lambda s: s.size, reverse=True)
CORES = len(os.sched_getaffinity(0))


def bare_render(data: bytes) -> int:
    """The renditions' total bytes: decode once, cascade, encode as pipeline.py does."""
    image = pyvips.Image.thumbnail_buffer(data, ORDERED[0].size, height=ORDERED[0].size,
                                          size="down").copy_memory()  # fmt: skip
    total = 0
    for spec in ORDERED:
        if max(image.width, image.height) > spec.size:
            image = image.thumbnail_image(spec.size, height=spec.size, size="down").copy_memory()
        if spec.format == "webp":
            total += len(image.webpsave_buffer(Q=spec.quality, effort=2, keep=0))
        else:
            total += len(image.jpegsave_buffer(Q=spec.quality, interlace=True,
                                               optimize_coding=True, keep=0))  # fmt: skip
    return total


@dataclass(frozen=True)
class Layout:
    """`processes` × `threads` Python threads, each process with `vips` libvips threads
    (0: libvips' default, one per core)."""

    processes: int
    threads: int
    vips: int

    def __str__(self) -> str:
        vips = "default" if self.vips == 0 else str(self.vips)
        processes = f"{self.processes} process{'es' * (self.processes > 1)}"
        threads = f"{self.threads} thread{'s' * (self.threads > 1)}"
        return f"{processes} × {threads}, vips concurrency {vips}"


LAYOUTS = (
    Layout(1, CORES, 1),
    Layout(1, CORES, 0),
    Layout(CORES, 1, 1),
    Layout(CORES, 1, 0),
    Layout(1, 2 * CORES, 1),
)


def _share(paths: list[str], threads: int, vips: int, passes: int, start: float) -> float:
    """One process's part: warm every thread, wait for `start` (wall clock), render its
    photos `passes` times over; returns when it finished (wall clock)."""
    if vips:
        pyvips.concurrency_set(vips)
    blobs = [Path(p).read_bytes() for p in paths]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(bare_render, blobs[:threads] or blobs))
        time.sleep(max(0.0, start - time.time()))
        list(pool.map(bare_render, blobs * passes))
    return time.time() if time.time() - start > 0 else float("nan")


def rate(paths: list[Path], layout: Layout, passes: int = 1) -> float:
    """photos/s of the bare loop in `layout`: the photos split between its processes, timed
    from a common start once every process is warm to the last one's end."""
    names = [str(p) for p in paths]
    shares = [names[i :: layout.processes] for i in range(layout.processes)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(layout.processes) as pool:
        pool.map(_ready, range(layout.processes))  # interpreters and pyvips imported
        start = time.time() + 3.0  # every process warm by then
        ends = pool.starmap(_share, [(s, layout.threads, layout.vips, passes, start)
                                     for s in shares])  # fmt: skip
    return len(paths) * passes / (max(ends) - start)


def _ready(_: int) -> int:
    return os.getpid()


def best_layout(paths: list[Path], passes: int = 1) -> tuple[Layout, dict[Layout, float]]:
    """Every layout once on these files; the fastest and every layout's photos/s."""
    rates = {layout: rate(paths, layout, passes) for layout in LAYOUTS}
    return max(rates, key=lambda layout: rates[layout]), rates


@dataclass
class Versus:
    """darkroom end to end against the best bare layout, round by round."""

    layout: Layout
    layouts: dict[Layout, float]
    darkroom: list[float]
    bare: list[float]

    @property
    def ratios(self) -> list[float]:
        return [d / b for d, b in zip(self.darkroom, self.bare, strict=True)]


def versus(drain: Callable[[], float], paths: list[Path], passes: int, rounds: int) -> Versus:
    """The layout search, then `rounds` rounds of a darkroom drain (its photos/s from
    `drain`) and the best layout back to back: this machine's speed drifts within
    minutes and is shared, so each ratio is of one round's pair."""
    layout, layouts = best_layout(paths, passes)
    darkroom, loop = [], []
    for _ in range(rounds):
        darkroom.append(drain())
        loop.append(rate(paths, layout, passes))
    return Versus(layout, layouts, darkroom, loop)
