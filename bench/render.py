"""Render throughput: pipeline.render in threads vs the warm RenderPool vs Pillow.

    .venv/bin/python bench/render.py [--rounds N] [--out docs/benchmarks.md]

Uses the JPEGs of ../shared/corpus when that folder exists, else those of tests/photos.
Each mode runs in a fresh interpreter, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from pillow import pillow_render
from report import ROOT, corpus, machine, write_section

MODES = [("threads", 1), ("threads", 2), ("processes", 1), ("processes", 2),
         ("pillow", 1), ("pillow", 2)]  # fmt: skip


def run_mode(mode: str, concurrency: int, rounds: int) -> dict[str, float]:
    """Runs in a child interpreter: one warm-up, then `rounds` passes over the corpus."""
    import anyio
    import pyvips

    from darkroom.image import pipeline
    from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions

    settings, specs = Settings(), list(parse_renditions(DEFAULT_RENDITIONS))
    photos = [p.read_bytes() for p in corpus()[1]]
    headers = [pyvips.Image.new_from_buffer(d, "") for d in photos]
    megapixels = sum(h.width * h.height for h in headers) / 1e6
    jobs = photos * rounds

    def one(data: bytes) -> object:
        if mode == "pillow":
            return pillow_render(data)
        return pipeline.render(data, specs, settings.max_pixels)

    if mode == "processes":
        from darkroom.image.renderer import RenderPool

        child_peak_mb = 0

        async def isolated() -> float:
            pool = RenderPool.from_settings(
                msgspec.structs.replace(settings, concurrency=concurrency)
            )

            async def job(data: bytes) -> None:
                nonlocal child_peak_mb
                result = await pool.render(data, specs)
                child_peak_mb = max(child_peak_mb, result.peak_rss_mb)

            async with pool:
                async with anyio.create_task_group() as tg:  # warm-up: every process once
                    for _ in range(concurrency):
                        tg.start_soon(job, photos[0])
                start = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for data in jobs:
                        tg.start_soon(job, data)
                return time.perf_counter() - start

        seconds = anyio.run(isolated)
    else:
        child_peak_mb = 0
        one(photos[0])
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, jobs))
        seconds = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Render children fork from a forkserver, so they report their own peak RSS.
    children = child_peak_mb if mode == "processes" else 0
    return {"seconds": seconds, "photos": len(jobs), "mp": megapixels * rounds,
            "rss_mb": own, "child_rss_mb": children}  # fmt: skip


def measure(rounds: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for mode, concurrency in MODES:
        cmd = [sys.executable, __file__, "--child", mode, str(concurrency), "--rounds", str(rounds)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        row = json.loads(out.splitlines()[-1]) | {"mode": mode, "concurrency": concurrency}
        row["photos_s"] = row["photos"] / row["seconds"]
        row["mp_s"] = row["mp"] / row["seconds"]
        results.append(row)
        print(f"  {mode} x{concurrency}: {row['photos_s']:.2f} photos/s", file=sys.stderr)
    return results


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | concurrency | photos/s | MP/s | peak RSS (MB) | largest child RSS (MB) |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    names = {"threads": "pipeline.render, threads", "processes": "RenderPool, warm processes",
             "pillow": "Pillow (colour-managed), threads"}  # fmt: skip
    for r in rows:
        child = f"{r['child_rss_mb']:.0f}" if r["child_rss_mb"] else "–"
        lines.append(f"| {names[r['mode']]} | {r['concurrency']} | {r['photos_s']:.2f} "
                     f"| {r['mp_s']:.1f} | {r['rss_mb']:.0f} | {child} |")  # fmt: skip
    return "\n".join(lines)


def conclusion(rows: list[dict[str, Any]]) -> str:
    """One paragraph, every claim in it computed from the rows."""
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    parts = []
    for c in (1, 2):
        t, p = by[("threads", c)]["photos_s"], by[("processes", c)]["photos_s"]
        (win, hi), (lose, lo) = sorted([("threads", t), ("processes", p)], key=lambda x: -x[1])
        gap = (
            f"{win} are {hi / lo - 1:.0%} faster than {lose}"
            if hi / lo > 1.05
            else "both are level"
        )
        parts.append(f"at concurrency {c} {gap} ({win} {hi:.2f} vs {lose} {lo:.2f} photos/s)")
    t2, p2 = by[("threads", 2)], by[("processes", 2)]
    loss = 1 - p2["photos_s"] / t2["photos_s"]
    cost = (
        f"isolation costs {loss:.0%} of throughput"
        if loss > 0.05
        else "isolation costs nothing measurable"
    )
    rss = p2["rss_mb"] + 2 * p2["child_rss_mb"]  # parent + two workers, an upper bound
    vips = max(t2["photos_s"], p2["photos_s"]) / by[("pillow", 2)]["photos_s"]
    pillow = (f"libvips renders {vips:.1f}x as fast as Pillow" if vips >= 1
              else f"Pillow renders {1 / vips:.1f}x as fast as libvips")  # fmt: skip
    return (
        f"Render-only, JPEG inputs: {'; '.join(parts)}: {cost}. Peak memory at concurrency "
        f"2 is {t2['rss_mb']:.0f} MB for threads and at most {rss:.0f} MB for processes "
        f"(parent + 2 x largest worker). At concurrency 2 {pillow}, both converting embedded "
        "profiles to sRGB. In threads mode libvips runs its own thread pool inside each "
        "render; a render process gets cores / concurrency libvips threads."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes over the corpus per mode")
    parser.add_argument("--out", type=Path, help="write the render section of this report")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child[0], int(args.child[1]), args.rounds)))
        return
    label, photos = corpus()
    print(f"{len(photos)} JPEGs from {label}, {args.rounds} rounds per mode", file=sys.stderr)
    rows = measure(args.rounds)
    body = table(rows)
    print(body, "", conclusion(rows), sep="\n")
    print("(libvips CLI: not in the pyvips binary wheel, not measured)", file=sys.stderr)
    if args.out:
        report = [
            "## Render only (bench/render.py)", "",
            f"- {machine()}",
            f"- input: {len(photos)} JPEGs from `{label}`, {args.rounds} rounds per mode, each "
            "mode in a fresh interpreter",
            "- the libvips command line (`vips`, `vipsthumbnail`) is not installed with the "
            "pyvips binary wheel, so it is not measured", "",
            body, "", conclusion(rows), "",
        ]  # fmt: skip
        write_section(args.out, "render", "\n".join(report))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
