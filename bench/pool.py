"""The render pool's own figures: what a process start costs, and whether a warm process creeps.

    .venv/bin/python bench/pool.py [--out docs/benchmarks.md]

1. Tiny 64×48 PNGs through `RenderPool` (2 slots) at several DARKROOM_RENDERS_PER_PROCESS:
   photos/s and CPU ms per photo of this process and every render process.
2. One render process kept for `--creep` photos cycling through the whole corpus: its
   resident memory between photos, to choose DARKROOM_RENDER_MAX_RSS_MB and show the bound.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import anyio
from e2e import tiny_pngs
from report import corpus, machine, write_section

from darkroom.image.renderer import RenderPool
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions

SPECS = parse_renditions(DEFAULT_RENDITIONS)
PER_PROCESS = (1, 10, 100, 500, 2000)


def pool(
    slots: int, renders_per_process: int, keep_mb: int = Settings().render_keep_mb
) -> RenderPool:
    return RenderPool(slots, max_pixels=Settings().max_pixels, timeout_s=120, memory_mb=2048,
                      renders_per_process=renders_per_process, max_rss_mb=10**6,
                      keep_mb=keep_mb)  # fmt: skip


def cpu_s() -> float:
    """CPU of this process, of its forkserver and of every render process the forkserver
    has reaped (its cutime/cstime): all of it once a pool is closed."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    me, tick = str(os.getpid()), os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:  # utime, stime, cutime, cstime are fields 14-17 of stat
                total += sum(int(f) for f in fields[11:15]) / tick
    return total


async def throughput(blobs: list[bytes], per_process: int) -> tuple[float, float, int]:
    renderer = pool(2, per_process)
    async with renderer:
        started, cpu = time.perf_counter(), cpu_s()
        async with anyio.create_task_group() as group:
            for blob in blobs:
                group.start_soon(renderer.render, blob, SPECS)
        seconds = time.perf_counter() - started
    cpu_ms = (cpu_s() - cpu) * 1000 / len(blobs)
    return len(blobs) / seconds, cpu_ms, renderer.started


async def creep(paths: list[Path], count: int) -> list[tuple[int, int]]:
    """(photos done, RSS MB of the one render process) after each photo."""
    blobs = [p.read_bytes() for p in paths]
    renderer = pool(1, 10**9, keep_mb=0)  # what it holds, not what it keeps for the next photo
    samples = []
    async with renderer:
        [pid] = renderer.pids()
        for i in range(count):
            await renderer.render(blobs[i % len(blobs)], SPECS)
            samples.append((i + 1, _rss_mb(pid)))
    return samples


def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


async def measure(tiny: list[bytes], creep_count: int) -> str:
    lines = ["| DARKROOM_RENDERS_PER_PROCESS | photos/s | CPU ms per photo (all processes) "
             "| processes started |", "|---:|---:|---:|---:|"]  # fmt: skip
    for per_process in PER_PROCESS:
        rate, cpu_ms, started = await throughput(tiny, per_process)
        lines.append(f"| {per_process} | {rate:.0f} | {cpu_ms:.1f} | {started} |")
        print(f"  renders_per_process {per_process}: {rate:.0f}/s {cpu_ms:.1f} ms", file=sys.stderr)
    label, photos = corpus((".jpg", ".jpeg", ".png", ".webp", ".gif", ".avif", ".heic"))
    samples = await creep(photos, creep_count)
    marks = sorted({1, len(photos), 100, 200, 500, creep_count} & {i for i, _ in samples})
    by = dict(samples)
    rss = ["| photos rendered by one process | " + " | ".join(map(str, marks)) + " | max |",
           "|---|" + "---:|" * (len(marks) + 1),
           "| its RSS between photos (MB) | " + " | ".join(str(by[m]) for m in marks)
           + f" | {max(r for _, r in samples)} |"]  # fmt: skip
    return "\n".join([
        "## The render pool (bench/pool.py)", "",
        f"- {machine()}",
        f"- {len(tiny)} tiny 64×48 PNGs through `RenderPool` with 2 slots; CPU counts this "
        "process, its forkserver and every render process", "",
        *lines, "",
        f"One render process kept for {creep_count} photos cycling through all "
        f"{len(photos)} files of `{label}` (every format, up to 12 MP), its RSS read right "
        "after each photo with `DARKROOM_RENDER_KEEP_MB=0`, so the process returns freed "
        "memory (`malloc_trim`) before each reading and the row shows what it really holds "
        "(with the default 128, a busy process keeps what it freed while at most 128 MB "
        "resident, and the readings would show that bound):", "",
        *rss, "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the pool section of this report")
    parser.add_argument("--tiny", type=int, default=600)
    parser.add_argument("--creep", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="darkroom-pool-") as tmp:
        tiny = [p.read_bytes() for p in tiny_pngs(Path(tmp), args.tiny)]
    body = anyio.run(measure, tiny, args.creep)
    print(body)
    if args.out:
        write_section(args.out, "pool", body)


if __name__ == "__main__":
    main()
