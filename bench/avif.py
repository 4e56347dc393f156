"""Bytes and quality, AVIF against the JPEG fallback: bytes at equal SSIMULACRA2, encode CPU
per rendition size and effort, and what inline AVIF would add to a photo's first render.

    .venv/bin/python bench/avif.py [--out docs/benchmarks.md] [--limit N]

For each distinct camera scene of the corpus (bench/quality.py's), the 1024 px pixels are
made as the pipeline hands them to an encoder; JPEG at the fallback's quality (82) and AVIF
over a grid of efforts, qualities, chroma subsampling and bit depth are scored with
SSIMULACRA2 against those pixels. "Bytes at equal score" interpolates each photo's AVIF
bytes at its own JPEG score (bytes against score, piecewise linear over the quality grid).
Needs the `bench` group (ssimulacra2).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import pyvips
import redis
from quality import SCENES
from report import corpus, machine, write_section
from ssimulacra2 import compute_ssimulacra2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from darkroom.image import formats, pipeline
from darkroom.settings import DEFAULT_RENDITIONS, parse_renditions

JPEG_Q = 82
QUALITIES = (50, 58, 64, 70, 76)
# (label, effort, heifsave options): 8-bit 4:2:0 at three efforts, then 4:4:4 and 10-bit
GRID = (
    ("effort 0", 0, {}),
    ("effort 2", 2, {}),
    ("effort 4", 4, {}),
    ("effort 2, 4:4:4", 2, {"subsample_mode": "off"}),
    ("effort 2, 10-bit", 2, {"bitdepth": 10}),
    ("effort 3, 4:4:4", 3, {"subsample_mode": "off"}),
    ("effort 4, 4:4:4", 4, {"subsample_mode": "off"}),
)
SIZES = (2048, 1024, 320)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(encode: object) -> tuple[bytes, float]:
    started = cpu_s()
    out = encode()  # type: ignore[operator]
    return bytes(out), cpu_s() - started


def jpeg(image: pyvips.Image) -> bytes:
    return bytes(image.jpegsave_buffer(Q=JPEG_Q, interlace=True, optimize_coding=True, keep=0))


def avif(image: pyvips.Image, q: int, effort: int, options: dict) -> bytes:
    return bytes(image.heifsave_buffer(Q=q, compression="av1", effort=effort, keep=0, **options))


def score(reference: bytes, data: bytes) -> float:
    return float(compute_ssimulacra2(io.BytesIO(reference), io.BytesIO(data)))


def pixels(data: bytes, size: int) -> pyvips.Image:
    """The rendition's pixels as the pipeline encodes them (one PNG rendition, lossless)."""
    [png] = pipeline.render(data, parse_renditions(f"p:{size}:png"), 100_000_000).renditions
    return pyvips.Image.new_from_buffer(png.data, "").copy_memory()


def measure(photos: list[Path], grid: list[tuple[str, int, dict]]) -> tuple[list[dict], dict]:
    """Per photo: JPEG (bytes, score, cpu) and AVIF {(label, q): (bytes, score, cpu)}."""
    rows, cpu = [], {}
    for path in photos:
        image = pixels(path.read_bytes(), 1024)
        reference = bytes(image.pngsave_buffer(compression=1))
        data, seconds = timed(lambda image=image: jpeg(image))
        row = {"photo": path.name, "jpeg": (len(data), score(reference, data), seconds)}
        for label, effort, options in grid:
            for q in QUALITIES:
                out, seconds = timed(lambda: avif(image, q, effort, options))  # noqa: B023
                row[label, q] = (len(out), score(reference, out), seconds)
                cpu[label] = cpu.get(label, 0.0) + seconds
        rows.append(row)
        print(f"  {path.name}: jpeg {row['jpeg'][0]} B {row['jpeg'][1]:.1f}", file=sys.stderr)
    return rows, cpu


def at_score(row: dict, label: str, target: float) -> float:
    """AVIF bytes at `target` by linear interpolation over the quality grid (clamped)."""
    points = sorted((row[label, q][1], row[label, q][0]) for q in QUALITIES)
    if target <= points[0][0]:
        return points[0][1]
    for (s0, b0), (s1, b1) in itertools.pairwise(points):
        if s0 <= target <= s1:
            return b0 + (b1 - b0) * (target - s0) / max(s1 - s0, 1e-9)
    return points[-1][1] * 1.0  # above the grid: the top quality's bytes (a lower bound)


def equal_score_table(rows: list[dict], cpu: dict, grid: list[tuple[str, int, dict]]) -> str:
    lines = ["| AVIF setting | bytes at each photo's JPEG score, vs JPEG q82 (total) | "
             "per photo (min..max) | encode CPU per 1024 px photo |",
             "|---|---:|---:|---:|"]  # fmt: skip
    total_jpeg = sum(r["jpeg"][0] for r in rows)
    for label, _, _ in grid:
        ratios = [at_score(r, label, r["jpeg"][1]) / r["jpeg"][0] for r in rows]
        total = sum(at_score(r, label, r["jpeg"][1]) for r in rows)
        per_photo = cpu[label] / (len(rows) * len(QUALITIES))
        lines.append(f"| {label} | {total / total_jpeg - 1:+.1%} | {min(ratios) - 1:+.0%}.."
                     f"{max(ratios) - 1:+.0%} | {per_photo * 1000:.0f} ms |")  # fmt: skip
    jpeg_cpu = sum(r["jpeg"][2] for r in rows) / len(rows)
    lines.append(f"| (JPEG q82, the fallback) | {total_jpeg / 1024:.0f} KiB | | "
                 f"{jpeg_cpu * 1000:.0f} ms |")  # fmt: skip
    return "\n".join(lines)


def fixed_table(rows: list[dict], label: str) -> str:
    """At one fixed AVIF quality for every photo (what a rendition list sets): total bytes
    and the mean and worst score against JPEG's."""
    lines = ["| AVIF quality | total bytes vs JPEG | mean SSIMULACRA2 (JPEG: {:.1f}) | "
             "worst photo vs its JPEG |".format(_mean([r["jpeg"][1] for r in rows])),
             "|---:|---:|---:|---:|"]  # fmt: skip
    total_jpeg = sum(r["jpeg"][0] for r in rows)
    for q in QUALITIES:
        total = sum(r[label, q][0] for r in rows)
        mean = _mean([r[label, q][1] for r in rows])
        worst = min(r[label, q][1] - r["jpeg"][1] for r in rows)
        lines.append(f"| {q} | {total / total_jpeg - 1:+.1%} | {mean:.1f} | {worst:+.1f} |")
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def sizes_table(photos: list[Path], q: int) -> str:
    """Encode CPU per rendition size: JPEG 82, WebP 80 effort 2 (darkroom's), AVIF at `q`."""
    encoders = {
        "JPEG 82": lambda i: jpeg(i),
        "WebP 80, effort 2": lambda i: i.webpsave_buffer(Q=80, effort=2, keep=0),
        **{f"AVIF {q}, effort {e}": (lambda i, e=e: avif(i, q, e, {})) for e in (0, 1, 2, 4)},
    }
    spent = {(name, size): 0.0 for name in encoders for size in SIZES}
    for path in photos:
        for size in SIZES:
            image = pixels(path.read_bytes(), size)
            for name, encode in encoders.items():
                spent[name, size] += timed(lambda image=image, encode=encode: encode(image))[1]
    lines = ["| encoder | " + " | ".join(f"{s} px" for s in SIZES) + " |",
             "|---|" + "---:|" * len(SIZES)]  # fmt: skip
    for name in encoders:
        cells = [f"{spent[name, s] / len(photos) * 1000:.0f} ms" for s in SIZES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_table(photos: list[Path], heavy: str) -> str:
    """The first render's CPU and wall time: the default list, and the same with AVIF
    renditions beside it inline (what deferring them keeps off the first publish)."""
    lists = {
        "default list": DEFAULT_RENDITIONS,
        f"default + {heavy}": f"{DEFAULT_RENDITIONS},{heavy}",
    }
    lines = ["| renditions | CPU s per photo | wall s per photo |", "|---|---:|---:|"]
    for label, text in lists.items():
        specs, cpu, wall = parse_renditions(text), 0.0, 0.0
        for path in photos:
            data = path.read_bytes()
            started, begun = cpu_s(), time.perf_counter()
            pipeline.render(data, specs, 100_000_000)
            cpu, wall = cpu + cpu_s() - started, wall + time.perf_counter() - begun
        lines.append(f"| {label} | {cpu / len(photos):.2f} | {wall / len(photos):.2f} |")
    return "\n".join(lines)


DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/darkroom_bench_avif"
REDIS_URL = "redis://127.0.0.1:6379/0"
# A delivery's claim-to-publish time and render time, of the photo's first (interactive)
# publish, and the render time of its upgrade (bulk).
ATTEMPTS_SQL = """
SELECT lane, download_ms + render_ms + upload_ms + publish_ms AS ms, render_ms
FROM photo_attempts WHERE photo_id = ANY($1::uuid[]) AND outcome = 'published'
"""


def first_publish_table(photos: list[Path], heavy: str, rounds: int = 2) -> str:
    """Real `darkroom run --drain` workers (concurrency 2, local folder storage, a database
    of their own): an interactive photo's claim-to-publish time with the default list, with
    AVIF deferred beside it, and with AVIF inline; the lists alternate, `rounds` times."""
    tmp = Path(tempfile.mkdtemp(prefix="darkroom-bench-avif-"))
    inline = ",".join(f"{item}:inline" for item in heavy.split(","))
    lists = {"default list": DEFAULT_RENDITIONS,
             "default + AVIF deferred (upgrade in bulk)": f"{DEFAULT_RENDITIONS},{heavy}",
             "default + AVIF inline": f"{DEFAULT_RENDITIONS},{inline}"}  # fmt: skip
    subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                    DATABASE_URL.rsplit("/", 1)[1]], check=True)  # fmt: skip
    _cli(tmp, "avif-setup", {}, "migrate")
    found: dict[str, list[tuple[str, float, float]]] = {label: [] for label in lists}
    try:
        for turn in range(rounds):
            for label, text in lists.items():
                stream = f"avif-{os.getpid()}-{turn}-{len(found[label])}-{hash(label) % 999}"
                ids = _cli(tmp, stream, {}, "ingest", *map(str, photos)).split()
                _cli(tmp, stream, {"DARKROOM_RENDITIONS": text, "DARKROOM_CONCURRENCY": "2"},
                     "run", "--drain")  # fmt: skip
                found[label] += asyncio.run(_attempts(ids))
                client = redis.Redis.from_url(REDIS_URL)
                client.delete(*(f"{{{stream}}}:{k}" for k in ("photos", "photos:bulk", "dead")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["| renditions | first publish, claim to commit (median ms) | its render (median ms) "
             "| upgrade's render (median ms) |", "|---|---:|---:|---:|"]  # fmt: skip
    for label, rows in found.items():
        first = [(ms, render) for lane, ms, render in rows if lane == "interactive"]
        upgrade = [render for lane, _, render in rows if lane == "bulk"]
        lines.append(f"| {label} | {statistics.median(m for m, _ in first):.0f} | "
                     f"{statistics.median(r for _, r in first):.0f} | "
                     f"{statistics.median(upgrade) if upgrade else 0:.0f} |")  # fmt: skip
    return "\n".join(lines)


def _cli(tmp: Path, stream: str, extra: dict[str, str], *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")} | {
        "DARKROOM_REDIS_URL": REDIS_URL, "DARKROOM_DATABASE_URL": DATABASE_URL,
        "DARKROOM_STORAGE_URL": f"file:{tmp / 'storage'}", "DARKROOM_LOG_FORMAT": "json",
        "DARKROOM_STREAM": f"{{{stream}}}:photos",
        "DARKROOM_DEAD_LETTER_STREAM": f"{{{stream}}}:dead", **extra,
    }  # fmt: skip
    command = [sys.executable, "-m", "darkroom", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tmp)
    return done.stdout


async def _attempts(ids: list[str]) -> list[tuple[str, float, float]]:
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        rows = await conn.fetch(ATTEMPTS_SQL, [uuid.UUID(i) for i in ids])
    finally:
        await conn.close()
    return [(r["lane"], float(r["ms"]), float(r["render_ms"])) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--limit", type=int, default=len(SCENES))
    parser.add_argument("--settings", help="only these GRID labels (;-separated), no report")
    parser.add_argument("--first-publish", action="store_true", help="only the workers' table")
    args = parser.parse_args()
    pyvips.concurrency_set(1)
    name, photos = corpus()
    photos = [p for p in photos if p.stem.startswith(SCENES)][: args.limit] or photos[: args.limit]
    if args.first_publish:
        q = formats.AVIF_QUALITY
        print(first_publish_table(photos, f"medium:1024:avif:{q},large:2048:avif:{q}"))
        return
    grid = [g for g in GRID if not args.settings or g[0] in args.settings.split(";")]
    rows, cpu = measure(photos, grid)
    if args.settings:  # a look at a few settings: their tables only
        print(equal_score_table(rows, cpu, grid))
        for label, _, _ in grid:
            print(f"\n{label}:\n{fixed_table(rows, label)}")
        return
    q, effort = formats.AVIF_QUALITY, formats.AVIF_EFFORT
    heavy = f"medium:1024:avif:{q},large:2048:avif:{q}"
    body = "\n\n".join([
        "## Bytes and quality: AVIF against the JPEG fallback (bench/avif.py)",
        f"{machine()}; {name}, {len(photos)} photos; one libvips thread; CPU is user+system "
        "seconds of this process (the machine was shared: indicative, compare side by side)."
        f" Scored at 1024 px against the pixels encoded; JPEG q{JPEG_Q} as darkroom encodes "
        "it (progressive, optimized Huffman).",
        "AVIF bytes at the JPEG fallback's own SSIMULACRA2, per photo:",
        equal_score_table(rows, cpu, grid),
        f"At one fixed AVIF quality (effort {effort}, 4:2:0, 8-bit: darkroom's settings):",
        fixed_table(rows, f"effort {effort}"),
        f"Encode CPU per rendition size (AVIF at q{q}; mean per photo):",
        sizes_table(photos, q),
        "A photo's render, the default list alone and with AVIF renditions inline:",
        render_table(photos, heavy),
        "Through real workers: the interactive photo's first publish, and its upgrade:",
        first_publish_table(photos, heavy),
    ])  # fmt: skip
    print(body)
    if args.out:
        write_section(args.out, "avif", body)


if __name__ == "__main__":
    main()
