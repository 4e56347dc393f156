"""darkroom end to end against the limit (a bare pyvips loop) and against sharp with its defaults.

    .venv/bin/python bench/limit.py [--out docs/benchmarks.md]

The bare loop decodes once (shrink-on-load to the largest rendition), cascades the same four
renditions with the same save options, on one thread per core with one libvips thread each,
and does nothing else: no facts, no placeholders, no checks. darkroom is one real
`darkroom run --drain` worker against a dedicated redis-server and database (capacity.py's
rig, in a database of its own, `darkroom_limit`). On the large JPEGs, sharp
(bench/sharp/render.mjs, node) makes the same four renditions the idiomatic sharp way with its
own defaults; without node or npm that column is n/a. All run side by side in one process
run, on the same files, so the ratios are what counts on a shared machine.
`PYTHONPATH=<old checkout>/src` measures an older darkroom the same way.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
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
from e2e import CORES, PR_SET_CHILD_SUBREAPER, SPECS, Rig, large_jpegs, tiny_pngs
from report import ROOT, machine, write_section

import darkroom

ORDERED = sorted(SPECS, key=lambda s: s.size, reverse=True)
SHARP = ROOT / "bench" / "sharp"
DATABASE = "darkroom_limit"  # not capacity.py's: a capacity run beside this one would share it
Sharp = dict[str, Any] | None  # render.mjs's JSON: per_s, rounds, in_flight, versions


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


def bare_loop(paths: list[Path], rounds: int = 2) -> float:
    """photos/s of the bare loop on one thread per core (best of `rounds`)."""
    pyvips.concurrency_set(1)
    blobs = [p.read_bytes() for p in paths]
    bare_render(blobs[0])
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        with ThreadPoolExecutor(CORES) as pool:
            list(pool.map(bare_render, blobs))
        best = max(best, len(blobs) / (time.perf_counter() - started))
    return best


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


def darkroom_e2e(rig: Rig, probe: capacity.Probe, paths: list[Path], name: str) -> float:
    capacity.produce(rig, probe, name, paths)
    return float(capacity.consume(rig, probe, name, len(paths))["per_s"])


def measure(tmp: Path, rig: Rig, probe: capacity.Probe) -> tuple[list[str], Sharp]:
    rows, sharp = [], None
    workloads = (("24 large camera JPEGs (8–12 MP)", large_jpegs()),
                 ("300 tiny PNGs (64×48)", tiny_pngs(tmp / "tiny", 300)))  # fmt: skip
    for i, (name, paths) in enumerate(workloads):
        print(f"  {name}", file=sys.stderr)
        e2e_per_s = darkroom_e2e(rig, probe, paths, f"limit-{i}")
        limit = bare_loop(paths)
        if i == 0:  # sharp on the large JPEGs only, right after darkroom and the bare loop
            sharp = sharp_loop(paths)
        against = sharp_cells(e2e_per_s, sharp) if i == 0 else "– | –"
        rows.append(f"| {name} | {e2e_per_s:.2f} | {limit:.2f} | **{e2e_per_s / limit:.2f}×** "
                    f"| {against} |")  # fmt: skip
    return rows, sharp


def sharp_cells(e2e_per_s: float, sharp: Sharp) -> str:
    if sharp is None:
        return "n/a | n/a"
    return f"{sharp['per_s']:.2f} | **{e2e_per_s / sharp['per_s']:.2f}×**"


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
            rows, sharp = measure(tmp, rig, capacity.Probe(client))
        finally:
            client.shutdown(nosave=True)
    source = Path(darkroom.__file__).resolve().parents[1]
    origin = "this checkout" if source == ROOT / "src" else f"`{source.parent.name}/{source.name}`"
    body = "\n".join([
        "## End to end against the limit (bench/limit.py)", "",
        f"- {head}; darkroom from {origin}",
        "- one `darkroom run --drain` worker (default settings, concurrency = cores), "
        "a dedicated redis-server and database, local-folder storage; the bare loop decodes "
        f"once and encodes the same renditions with the same options on {CORES} threads, "
        "one libvips thread each", sharp_line(sharp), "",
        "| workload | darkroom end to end (photos/s) | bare pyvips loop (photos/s) | "
        "darkroom ÷ limit | sharp, its defaults (photos/s) | darkroom ÷ sharp |",
        "|---|---:|---:|---:|---:|---:|",
        *rows, "",
    ])  # fmt: skip
    print(body)
    if args.out:
        write_section(args.out, "limit", body)


if __name__ == "__main__":
    main()
