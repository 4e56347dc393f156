"""darkroom end to end against the limit (a bare pyvips loop) and against sharp with its defaults.

    .venv/bin/python bench/limit.py [--out docs/benchmarks.md]

The bare loop decodes once (shrink-on-load to the largest rendition), cascades the same four
renditions with the same save options, on one thread per core with one libvips thread each,
and does nothing else: no facts, no placeholders, no checks. darkroom is one real
`darkroom run --drain` worker against a dedicated redis-server and database (capacity.py's
rig, in a database of its own, `darkroom_limit`). On the large JPEGs, sharp
(bench/sharp/render.mjs, node) makes the same four renditions the idiomatic sharp way with its
own defaults; without node or npm that column is n/a. All run side by side in one process
run, on the same files, in alternating rounds, so the ratios are what counts on a shared
machine.
`PYTHONPATH=<old checkout>/src` measures an older darkroom the same way.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import capacity
import e2e
import pyvips
from bare import bare_render
from e2e import CORES, PR_SET_CHILD_SUBREAPER, Rig, large_jpegs, tiny_pngs
from report import ROOT, machine, write_section

import darkroom

SHARP = ROOT / "bench" / "sharp"
DATABASE = "darkroom_limit"  # not capacity.py's: a capacity run beside this one would share it
Costs = dict[str, float]
Sharp = dict[str, Any] | None  # render.mjs's JSON: per_s, rounds, in_flight, versions


def bare_loop(paths: list[Path]) -> float:
    """photos/s of the bare loop on one thread per core (after a warm-up photo)."""
    pyvips.concurrency_set(1)
    blobs = [p.read_bytes() for p in paths]
    bare_render(blobs[0])
    started = time.perf_counter()
    with ThreadPoolExecutor(CORES) as pool:
        list(pool.map(bare_render, blobs))
    return len(blobs) / (time.perf_counter() - started)


def sharp_ready() -> bool:
    """node and bench/sharp's locked packages are there (`npm ci` when they are missing)."""
    if shutil.which("node") is None:
        return no_sharp("node not found")
    if (SHARP / "node_modules").is_dir():
        return True
    if shutil.which("npm") is None:
        return no_sharp("npm not found")
    done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=SHARP, check=False)
    return done.returncode == 0 or no_sharp("npm ci failed in bench/sharp")


def no_sharp(reason: str) -> bool:
    print(f"  note: {reason}: the sharp column is n/a (node >= 20 and npm needed)", file=sys.stderr)
    return False


def sharp_loop(paths: list[Path]) -> Sharp:
    """sharp's photos/s and versions (best of 2 rounds), or None without node."""
    if not sharp_ready():
        return None
    command = ["node", str(SHARP / "render.mjs"), *map(str, paths)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return dict(json.loads(result.stdout))


def darkroom_e2e(rig: Rig, probe: capacity.Probe, paths: list[Path], name: str) -> Costs:
    """photos/s (first to last publish) and what each photo cost the worker's processes,
    PostgreSQL and Redis over the whole drain."""
    capacity.produce(rig, probe, name, paths)
    used, n = capacity.consume(rig, probe, name, len(paths)), len(paths)
    # commands run inside a script are counted by Redis beside the script's own call
    sent = [v for k, v in used["cmd"].items() if k not in capacity.SCRIPTED]
    redis_calls, redis_us = sum(c for c, _ in sent), sum(u for _, u in sent)
    return {"per_s": float(used["per_s"]), "cpu_ms": used["worker_cpu_s"] * 1000 / n,
            "pg_ms": used["pg_cpu_s"] * 1000 / n, "xacts": used["pg"]["xact_commit"] / n,
            "redis_calls": redis_calls / n, "redis_us": redis_us / n}  # fmt: skip


def cost_row(name: str, rounds: list[Costs]) -> str:
    def m(key: str) -> float:
        return _median([r[key] for r in rounds])

    return (f"| {name} | {m('cpu_ms'):.1f} | {m('pg_ms'):.2f} | {m('xacts'):.1f} | "
            f"{m('redis_calls'):.1f} | {m('redis_us'):.0f} |")  # fmt: skip


# ext4 without a journal (this machine's disk) passes over inodes freed in the last 60 s
# (360 s while their inode table block is dirty; written back within about 30 s) when it
# allocates new ones (fs/ext4/ialloc.c, recently_deleted): every file darkroom creates right
# after a mass delete (the temporary folders of the benches before this one) costs several
# times its settled system time, and the bare loop creates none. The run starts once that
# window has passed; docs/performance.md ("Fifth pass") gives what it is worth.
SETTLE_S = 65.0

# Rounds per workload, each darkroom then the bare loop (then sharp) back to back: this
# machine's speed drifts by a third within minutes, so each ratio is of one round's pair,
# and the report gives the medians.
ROUNDS = 5


def measure(tmp: Path, rig: Rig, probe: capacity.Probe) -> tuple[list[str], list[str], Sharp]:
    rows, costs, sharp = [], [], None
    workloads = (("24 large camera JPEGs (8–12 MP)", large_jpegs()),
                 ("300 tiny PNGs (64×48)", tiny_pngs(tmp / "tiny", 300)))  # fmt: skip
    for i, (name, paths) in enumerate(workloads):
        print(f"  {name}", file=sys.stderr)
        drains: list[Costs] = []
        limit, sharps = [], []
        for r in range(ROUNDS):
            drains.append(darkroom_e2e(rig, probe, paths, f"limit-{i}-{r}"))
            limit.append(bare_loop(paths))
            if i == 0:  # sharp on the large JPEGs only, right after darkroom and the loop
                sharp = sharp_loop(paths)
                sharps.append(sharp)
        darkroom = [d["per_s"] for d in drains]
        costs.append(cost_row(name, drains))
        ratios = [d / b for d, b in zip(darkroom, limit, strict=True)]
        against = sharp_cells(darkroom, sharps) if i == 0 else "– | –"
        rows.append(f"| {name} | {_median(darkroom):.2f} | {_median(limit):.2f} | "
                    f"**{_median(ratios):.2f}×** ({_spread(ratios)}) | {against} |")  # fmt: skip
    return rows, costs, sharp


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _spread(ratios: list[float]) -> str:
    return "–".join(f"{r:.2f}" for r in sorted(ratios))


def sharp_cells(darkroom: list[float], sharps: list[Sharp]) -> str:
    if any(s is None for s in sharps):
        return "n/a | n/a"
    per_s = [float(s["per_s"]) for s in sharps if s is not None]
    ratios = [d / s for d, s in zip(darkroom, per_s, strict=True)]
    return f"{_median(per_s):.2f} | **{_median(ratios):.2f}×** ({_spread(ratios)})"


def sharp_line(sharp: Sharp) -> str:
    if sharp is None:
        return "- sharp: n/a (node, npm or bench/sharp's packages missing; see the run's notes)"
    return (
        f"- sharp {sharp['sharp']} (its own libvips {sharp['libvips']}) with its defaults "
        "(bench/sharp/render.mjs): one auto-oriented pipeline per photo, cloned per "
        "rendition, fit inside, never enlarged, WebP effort 4 (darkroom: 2), baseline JPEG "
        f"(darkroom: progressive), libvips concurrency {sharp['concurrency']}, libuv pool "
        f"and cache as they come; {sharp['in_flight']} photos in flight (os.cpus())"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the limit section of this report")
    args = parser.parse_args()
    port = capacity.free_port()
    e2e.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    capacity.DATABASE = DATABASE  # the rig's probes read the module's name
    e2e.DATABASE_URL = f"postgresql://postgres@127.0.0.1:5432/{DATABASE}"
    with tempfile.TemporaryDirectory(prefix="darkroom-limit-") as name:
        tmp, head = Path(name), machine()
        client = capacity.start_redis(port, tmp)
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)  # after the daemon left
        try:
            subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                            DATABASE], check=True)  # fmt: skip
            rig = Rig(tmp)
            rig.cli("limit-setup", "migrate")
            print(f"  letting the disk settle for {SETTLE_S:g} s", file=sys.stderr)
            time.sleep(SETTLE_S)
            rows, costs, sharp = measure(tmp, rig, capacity.Probe(client))
        finally:
            client.shutdown(nosave=True)
    source = Path(darkroom.__file__).resolve().parents[1]
    origin = "this checkout" if source == ROOT / "src" else f"`{source.parent.name}/{source.name}`"
    body = "\n".join([
        "## End to end against the limit (bench/limit.py)", "",
        f"- {head}; darkroom from {origin}",
        "- one `darkroom run --drain` worker (default settings, concurrency = cores), "
        "a dedicated redis-server and database, local-folder storage (the run starts "
        f"{SETTLE_S:g} s after the benches before it deleted their files, see SETTLE_S); "
        "the bare loop decodes "
        f"once and encodes the same renditions with the same options on {CORES} threads, "
        "one libvips thread each", sharp_line(sharp),
        f"- {ROUNDS} rounds per workload, each darkroom, then the bare loop (then sharp), back "
        "to back; photos/s are the medians, each ratio the median of the rounds' own ratios "
        "(all of them in brackets)", "",
        "| workload | darkroom end to end (photos/s) | bare pyvips loop (photos/s) | "
        "darkroom ÷ limit | sharp, its defaults (photos/s) | darkroom ÷ sharp |",
        "|---|---:|---:|---:|---:|---:|",
        *rows, "",
        "What each photo cost over the whole drain (start-up and final sweep included; "
        "medians of the rounds): CPU of the worker process and its render processes, of "
        "its PostgreSQL backends, transactions committed, Redis commands and Redis server "
        "time.", "",
        "| workload | worker + render CPU (ms) | PostgreSQL CPU (ms) | PostgreSQL "
        "transactions | Redis commands | Redis server (µs) |",
        "|---|---:|---:|---:|---:|---:|",
        *costs, "",
    ])  # fmt: skip
    print(body)
    if args.out:
        write_section(args.out, "limit", body)


if __name__ == "__main__":
    main()
