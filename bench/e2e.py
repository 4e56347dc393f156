"""What users feel: end to end through real workers, against render-only loops, in one run.

    .venv/bin/python bench/e2e.py [--out docs/benchmarks.md] [--rss-photos 5000]

Real `darkroom run --drain` processes against the local Redis and PostgreSQL (a database of
its own, `darkroom_bench`, made afresh) with local-folder storage, on two workloads: the
corpus JPEGs of 8 MP and more (repeated to 24 photos) and 300 tiny 64×48 PNGs. Beside each,
in the same run and on the same files: render-only `pipeline.render` (decode once, the same
renditions, one thread per core), and render-only Pillow doing the same renditions with
colour management. Then the per-photo fixed cost in CPU ms (all CPU of the worker and its
render processes, less the render alone), 1 against 2 worker processes sharing one group,
RSS and PSS of the worker and its render processes over `--rss-photos` photos (a graph goes
to docs/bench-rss.png), and the worker's cProfile top entries.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import functools
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import bare
import pyvips
import redis
from pillow import pillow_render
from report import ROOT, corpus, machine, write_section

from darkroom.image.pipeline import render
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions

SPECS = parse_renditions(DEFAULT_RENDITIONS)
REDIS_URL = "redis://127.0.0.1:6379/0"
# Another name lets two benches run side by side without dropping each other's database.
DATABASE = os.environ.get("DARKROOM_BENCH_DATABASE", "darkroom_bench")
DATABASE_URL = f"postgresql://postgres@127.0.0.1:5432/{DATABASE}"
CORES = len(os.sched_getaffinity(0))
PR_SET_CHILD_SUBREAPER = 36


# -- inputs -----------------------------------------------------------------------------------


def large_jpegs(count: int = 24) -> list[Path]:
    _, photos = corpus()
    big = [p for p in photos if _megapixels(p) >= 8] or photos
    return [big[i % len(big)] for i in range(count)]


def _megapixels(path: Path) -> float:
    header = pyvips.Image.new_from_file(str(path))
    return header.width * header.height / 1e6


def tiny_pngs(folder: Path, count: int) -> list[Path]:
    """Distinct 64×48 RGB PNGs (an avatar or a sticker), made here."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        noise = pyvips.Image.gaussnoise(64, 48, mean=128, sigma=20 + i % 40)
        image = noise.bandjoin([noise.flip("horizontal"), noise.rot180()])
        path = folder / f"tiny-{i:05d}.png"
        image.cast("uchar").pngsave(str(path))
        paths.append(path)
    return paths


def mixed(folder: Path, count: int) -> list[Path]:
    """Every 10th photo from the whole corpus (all formats), the rest tiny PNGs."""
    _, photos = corpus((".jpg", ".jpeg", ".png", ".webp", ".gif", ".avif", ".heic"))
    tiny = tiny_pngs(folder, 300)
    return [photos[i // 10 % len(photos)] if i % 10 == 0 else tiny[i % 300] for i in range(count)]


# -- render-only baselines ----------------------------------------------------------------------


def render_only(paths: list[Path], threads: int = CORES) -> float:
    """pipeline.render on `threads` threads, decode once per photo: photos/s."""
    blobs = [p.read_bytes() for p in paths]
    render(blobs[0], SPECS, Settings().max_pixels)  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda b: render(b, SPECS, Settings().max_pixels), blobs))
    return len(blobs) / (time.perf_counter() - started)


def render_cpu_ms(paths: list[Path]) -> float:
    """CPU ms per photo of pipeline.render alone, one photo at a time."""
    blobs = [p.read_bytes() for p in paths]
    render(blobs[0], SPECS, Settings().max_pixels)
    started = time.process_time()
    for blob in blobs:
        render(blob, SPECS, Settings().max_pixels)
    return (time.process_time() - started) * 1000 / len(blobs)


def pillow_only(paths: list[Path], threads: int = CORES) -> float:
    blobs = [p.read_bytes() for p in paths]
    pillow_render(blobs[0])
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(pillow_render, blobs))
    return len(blobs) / (time.perf_counter() - started)


# -- real workers ---------------------------------------------------------------------------


@dataclass
class Run:
    """One drained backlog: throughput, CPU of every process involved, memory samples."""

    photos: int
    seconds: float  # first to last finished photo
    wall_s: float  # worker start to exit
    cpu_ms: float  # worker + render processes + forkserver
    samples: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    # PSS in kB at the sample of the highest total: the workers', then each other process's
    peak_split: tuple[int, list[int]] = (0, [])

    @property
    def per_s(self) -> float:
        return (self.photos - 1) / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class Rig:
    tmp: Path
    runs: int = 0
    # What `darkroom ingest` runs with beside the rig's settings (a traced producer's OTEL_*)
    ingest_env: dict[str, str] = field(default_factory=dict)

    def environ(self, stream: str, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
        return (
            base
            | {
                "DARKROOM_REDIS_URL": REDIS_URL,
                "DARKROOM_DATABASE_URL": DATABASE_URL,
                "DARKROOM_STORAGE_URL": f"file:{self.tmp / 'storage'}",
                "DARKROOM_STREAM": f"{{{stream}}}:photos",
                "DARKROOM_DEAD_LETTER_STREAM": f"{{{stream}}}:dead",
                "DARKROOM_LOG_FORMAT": "json",
            }
            | extra
        )

    def cli(self, stream: str, *args: str, **extra: str) -> str:
        command = [sys.executable, "-m", "darkroom", *args]
        result = subprocess.run(command, env=self.environ(stream, **extra), capture_output=True,
                                text=True, check=True, cwd=self.tmp)  # fmt: skip
        return result.stdout

    def setup(self) -> None:
        subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                        DATABASE_URL.rsplit("/", 1)[1]], check=True)  # fmt: skip
        self.cli("bench-setup", "migrate")

    def drain(self, paths: list[Path], workers: int = 1, sample: bool = False,
              profile: Path | None = None, **extra: str) -> Run:  # fmt: skip
        self.runs += 1
        stream = f"bench-{os.getpid()}-{self.runs}"
        self.cli(stream, "ingest", *map(str, paths), **self.ingest_env)
        before = _children_cpu_s()
        started = time.perf_counter()
        procs = [self._worker(stream, i, profile, extra) for i in range(workers)]
        sampler = Sampler([p.pid for p in procs]) if sample else None
        logs = [p.communicate()[1] for p in procs]
        wall = time.perf_counter() - started
        if sampler:
            sampler.stop()
        _reap_orphans()
        for proc, log in zip(procs, logs, strict=True):
            if proc.returncode != 0:
                raise SystemExit(f"worker exited {proc.returncode}:\n{log[-3000:]}")
        done = sorted(_done_times(logs))
        if len(done) != len(paths):
            raise SystemExit(f"{len(done)} of {len(paths)} photos finished")
        redis.Redis.from_url(REDIS_URL).delete(f"{{{stream}}}:photos", f"{{{stream}}}:dead")
        return Run(len(paths), done[-1] - done[0], wall, (_children_cpu_s() - before) * 1000,
                   sampler.samples if sampler else [], done,
                   sampler.peak if sampler else (0, []))  # fmt: skip

    def _worker(self, stream: str, i: int, profile: Path | None, extra: dict[str, str]) -> Any:
        prefix = ["-m", "cProfile", "-o", str(profile)] if profile else []
        command = [sys.executable, *prefix, "-m", "darkroom", "run", "--drain"]
        env = self.environ(stream, DARKROOM_CONSUMER=f"bench-{i}", **extra)
        return subprocess.Popen(command, env=env, cwd=self.tmp, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip


def _done_times(logs: list[str]) -> Iterator[float]:
    for log in logs:
        for line in log.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "entry done":
                    yield dt.datetime.fromisoformat(event["timestamp"]).timestamp()


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_orphans() -> None:
    """As a child subreaper this process inherits the forkserver and any render process left
    when a worker exits: wait for them so their CPU time is counted too. multiprocessing's
    resource tracker (bare.py's process pools start one) lives as long as this process."""
    me, tracker = os.getpid(), resource_tracker._resource_tracker._pid
    while kids := [p for p, parent in _parents().items() if parent == me and p != tracker]:
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


class Sampler:
    """Every 0.25 s: RSS of the workers, RSS of their descendants, PSS of them all."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.peak: tuple[int, list[int]] = (0, [])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            tree = _descendants(self.roots)
            workers = sum(_kb(p, "status", "VmRSS") for p in self.roots)
            children = [p for p in tree if p not in self.roots]
            rss = sum(_kb(p, "status", "VmRSS") for p in children)
            each = {p: _kb(p, "smaps_rollup", "Pss") for p in tree}
            pss = sum(each.values())
            if pss > sum(self.peak[1]) + self.peak[0]:
                others = sorted((k for p, k in each.items() if p not in self.roots), reverse=True)
                self.peak = (sum(each[p] for p in self.roots), others)
            self.samples.append((time.time(), workers, rss, pss, len(children)))


def _descendants(roots: list[int]) -> list[int]:
    parents = _parents()
    found, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(kids)
        frontier.extend(kids)
    return sorted(found)


def _parents() -> dict[int, int]:
    """Every process's parent, by process id."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
    return parents


def _kb(pid: int, name: str, field_name: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(f"{field_name}:"):
                return int(line.split()[1])
    return 0


# -- the report ---------------------------------------------------------------------------------


# Rounds per workload, darkroom then the bare loop back to back (see bare.versus).
ROUNDS = 3


def throughput_table(rig: Rig, tmp: Path) -> tuple[str, dict[str, Any]]:
    rows, layouts, facts = [], [], {}
    workloads = (("24 large camera JPEGs (8–12 MP)", large_jpegs(), 1),
                 ("300 tiny PNGs (64×48)", tiny_pngs(tmp / "tiny", 300), 4))  # fmt: skip
    for name, paths, passes in workloads:
        runs: list[Run] = []
        drain = functools.partial(_drained, rig, paths, runs)
        against = bare.versus(drain, paths, passes, ROUNDS)
        e2e, loop = _median(against.darkroom), _median(against.bare)
        vips, pil = render_only(paths), pillow_only(paths)
        spread = "–".join(f"{r:.2f}" for r in sorted(against.ratios))
        rows.append(f"| {name} | {e2e:.2f} | {loop:.2f} | **{_median(against.ratios):.2f}×** "
                    f"({spread}) | {vips:.2f} | {e2e / vips:.2f}× | {pil:.2f} |")  # fmt: skip
        layouts += [f"| {name} | {layout}{' (best)' * (layout == against.layout)} | {r:.1f} |"
                    for layout, r in against.layouts.items()]  # fmt: skip
        facts[name] = (sorted(runs, key=lambda r: r.per_s)[len(runs) // 2], vips, pil, paths)
        print(f"  {name}: e2e {e2e:.2f}, bare {loop:.2f} ({against.layout}), ratios {spread}, "
              f"render-only {vips:.2f}, Pillow {pil:.2f}", file=sys.stderr)  # fmt: skip
    head = [
        "| workload | darkroom end to end (photos/s) | bare pyvips loop, best layout "
        "(photos/s) | darkroom ÷ bare (each round) | render-only darkroom pipeline "
        f"({CORES} threads) | end to end ÷ render-only | render-only Pillow, colour-managed "
        f"({CORES} threads) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    tried = ["| workload | bare loop layout | photos/s |", "|---|---|---:|"]
    return "\n".join([*head, *rows, "", *tried, *layouts]), facts


def _drained(rig: Rig, paths: list[Path], runs: list[Run]) -> float:
    runs.append(rig.drain(paths))
    return runs[-1].per_s


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def fixed_cost(facts: dict[str, Any]) -> str:
    lines = ["| workload | CPU ms per photo, end to end (worker + render processes) | "
             "CPU ms per photo, render alone | fixed cost per photo (ms CPU) |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for name, (e2e, _, _, paths) in facts.items():
        total = e2e.cpu_ms / e2e.photos
        alone = render_cpu_ms(paths)
        lines.append(f"| {name} | {total:.1f} | {alone:.1f} | {total - alone:.1f} |")
    return "\n".join(lines)


def scaling(rig: Rig, tmp: Path) -> str:
    lines = ["| workload | 1 worker × concurrency 2 (photos/s) | 2 workers × concurrency 1, one "
             "group (photos/s) | 2 workers × concurrency 2, one group (photos/s) |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for name, paths in (("24 large camera JPEGs", large_jpegs()),
                        ("300 tiny PNGs", tiny_pngs(tmp / "tiny", 300))):  # fmt: skip
        one = rig.drain(paths, DARKROOM_CONCURRENCY="2")
        two = rig.drain(paths, workers=2, DARKROOM_CONCURRENCY="1")
        four = rig.drain(paths, workers=2, DARKROOM_CONCURRENCY="2")
        lines.append(f"| {name} | {one.per_s:.2f} | {two.per_s:.2f} | {four.per_s:.2f} |")
    return "\n".join(lines)


def memory(rig: Rig, tmp: Path, count: int, graph: Path) -> str:
    run = rig.drain(mixed(tmp / "tiny", count), sample=True, DARKROOM_CONCURRENCY="2")
    done = run.done_at
    points = [(sum(t >= d for d in done), w, r, p, n) for t, w, r, p, n in run.samples]
    totals = [(i, (w + r) / 1024, p / 1024) for i, w, r, p, _ in points]
    warm = [p for i, _, p in totals if count * 0.1 <= i < count * 0.2]
    late = [p for i, _, p in totals if i >= count * 0.9]
    growth = (_avg(late) / _avg(warm) - 1) if warm and late else float("nan")
    peak_rss = max((w + r) / 1024 for _, w, r, _, _ in points)
    peak_pss = max(p for _, _, p in totals)
    worker_peak = max(w / 1024 for _, w, _, _, _ in points)
    _plot(points, graph)
    return (
        f"{count} photos (every 10th from the corpus, all formats; the rest tiny PNGs), one "
        f"worker at concurrency 2, sampled every 0.25 s ({len(points)} samples), "
        f"{run.per_s:.1f} photos/s:\n\n"
        "| figure | MB |\n|---|---:|\n"
        f"| peak RSS, worker alone | {worker_peak:.0f} |\n"
        f"| peak RSS, worker + render processes + forkserver (sum, counts shared pages "
        f"twice) | {peak_rss:.0f} |\n"
        f"| peak PSS, worker + render processes + forkserver (shared pages split) | "
        f"{peak_pss:.0f} |\n"
        f"| at the peak: the worker's PSS; each other process's (forkserver, resource tracker, "
        f"render processes), largest first | {run.peak_split[0] / 1024:.0f}; "
        f"{', '.join(f'{k / 1024:.0f}' for k in run.peak_split[1])} |\n"
        f"| steady PSS after warm-up (median, photos 10–20 %) | {_avg(warm):.0f} |\n"
        f"| steady PSS at the end (median, photos 90–100 %) | {_avg(late):.0f} |\n\n"
        f"Growth from warm-up to the end: **{growth:+.1%}**. Graph: [{graph.name}]({graph.name}).\n"
    )


def _avg(values: list[float]) -> float:
    """The median: a large photo's brief spike is peak memory, not steady memory."""
    return statistics.median(values) if values else float("nan")


def _plot(points: list[tuple[int, int, int, int, int]], graph: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib missing (make bench installs it): no graph", file=sys.stderr)
        return
    done = [i for i, *_ in points]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(done, [w / 1024 for _, w, _, _, _ in points], label="worker RSS")
    ax.plot(done, [r / 1024 for _, _, r, _, _ in points], label="render processes + forkserver RSS")
    ax.plot(done, [p / 1024 for _, _, _, p, _ in points], label="all, PSS")
    ax.set_xlabel("photos finished")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.set_title("darkroom memory over a long run (concurrency 2)")
    fig.tight_layout()
    fig.savefig(graph, dpi=90)


def profile(rig: Rig, tmp: Path, top: int = 15) -> str:
    out = tmp / "worker.prof"
    rig.drain(tiny_pngs(tmp / "tiny", 300), profile=out, DARKROOM_CONCURRENCY="2")
    text = io.StringIO()
    stats = pstats.Stats(str(out), stream=text)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return "```\n" + "\n".join(lines[start - 1 : start + top + 1]) + "\n```"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the end-to-end section of this report")
    parser.add_argument("--rss-photos", type=int, default=5000)
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
    graph = (args.out.parent if args.out else ROOT / "docs") / "bench-rss.png"
    with tempfile.TemporaryDirectory(prefix="darkroom-bench-") as name:
        tmp, head = Path(name), machine()
        rig = Rig(tmp)
        rig.setup()
        print("throughput", file=sys.stderr)
        table, facts = throughput_table(rig, tmp)
        print("fixed cost, scaling", file=sys.stderr)
        cost, scale = fixed_cost(facts), scaling(rig, tmp)
        print(f"memory over {args.rss_photos} photos", file=sys.stderr)
        mem = memory(rig, tmp, args.rss_photos, graph)
        print("profile", file=sys.stderr)
        prof = profile(rig, tmp)
        shutil.rmtree(tmp / "storage", ignore_errors=True)
    body = "\n".join([
        "## End to end against render-only (bench/e2e.py)", "",
        f"- {head}",
        "- real `darkroom run --drain` workers (default settings unless said), local Redis and "
        "PostgreSQL, local-folder storage; photos/s counts from the first to the last finished "
        "photo; render-only loops run in this process on the same files",
        "- each workload: the bare loop's layouts once each (bench/bare.py), then "
        f"{ROUNDS} rounds of a darkroom drain and the best layout back to back; photos/s "
        "are medians, the ratio the median of the rounds' own ratios (all in brackets)", "",
        table, "",
        "### Fixed cost per photo", "",
        "All CPU time (user + system) of the worker, its forkserver and its render processes "
        "(this script is their child subreaper, so it reaps and counts them all), per photo, "
        "less `pipeline.render` alone on the same files. Redis and PostgreSQL server CPU is not "
        "counted.", "",
        cost, "",
        "### Workers sharing one group", "",
        scale, "",
        "### Memory over a long run", "",
        mem,
        "### Where the worker's own time goes (cProfile, 300 tiny PNGs, top 15 by own time)",
        "",
        "The event loop's thread only: render processes and anyio worker threads are not "
        "in it. `select`/`poll` time is the loop waiting.", "",
        prof, "",
    ])  # fmt: skip
    print(body)
    if args.out:
        write_section(args.out, "e2e", body)


if __name__ == "__main__":
    main()
