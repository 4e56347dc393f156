"""HDR gain maps: what the map costs a JPEG rendition in bytes and time, and that SDR photos
pay nothing for the HDR steps.

    .venv/bin/python bench/hdr.py [--photos N] [--rounds N] [--out docs/benchmarks.md]

Gain-map originals are made from the corpus JPEGs by tests/hdrcraft.py (libultrahdr through
uhdrsave, highlights up to 4× brighter), with a phone's quarter-size map and a full-size one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyvips
from report import ROOT, corpus, machine, write_section

sys.path.insert(0, str(ROOT))

from tests.hdrcraft import secondary_at, ultra_hdr

from darkroom.image import gainmap, pipeline
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions

SPECS = parse_renditions(DEFAULT_RENDITIONS)
JPEG_SPECS = [s for s in SPECS if s.format == "jpeg"] + list(
    parse_renditions("large:2048:jpeg:82,thumb:320:jpeg:82")
)
MAX_PIXELS = Settings().max_pixels


def jpeg_bytes(data: bytes) -> dict[str, int]:
    result = pipeline.render(data, JPEG_SPECS, MAX_PIXELS)
    return {f"{r.name} {r.width}px": len(r.data) for r in result.renditions}


def byte_rows(photos: list[bytes], scale: int) -> list[tuple[str, float, float, float]]:
    """Per rendition size: the median and worst ratio of bytes with the map to without."""
    ratios: dict[str, list[float]] = {}
    for photo in photos:
        uhdr = ultra_hdr(photo, scale=scale)
        with_map, sdr = jpeg_bytes(uhdr), jpeg_bytes(uhdr[: secondary_at(uhdr)])
        for name, size in with_map.items():
            ratios.setdefault(name.split()[0], []).append(size / sdr[name])
    sizes = {s.name: s.size for s in JPEG_SPECS}
    return [(f"{name} ({sizes[name]} px)", statistics.median(r), max(r), min(r))
            for name, r in ratios.items()]  # fmt: skip


def photos_per_s(photos: list[bytes], rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        for data in photos:
            pipeline.render(data, SPECS, MAX_PIXELS)
    return len(photos) * rounds / (time.perf_counter() - start)


def without_hdr_steps(run: Callable[[], float]) -> float:
    """The same run with the HDR steps replaced by no-ops (today's code path for SDR)."""
    saved = gainmap.check, gainmap.drop, gainmap.carries
    gainmap.check, gainmap.drop, gainmap.carries = (
        (lambda h, m: False),
        (lambda i: i),
        (lambda i: False),
    )  # type: ignore[assignment]
    try:
        return run()
    finally:
        gainmap.check, gainmap.drop, gainmap.carries = saved


def sdr_rows(photos: list[bytes], rounds: int) -> list[float]:
    """Alternating runs with and without the HDR steps, so drift of the shared machine hits both."""
    pipeline.render(photos[0], SPECS, MAX_PIXELS)  # warm-up
    runs: list[float] = []
    for _ in range(3):
        runs.append(photos_per_s(photos, rounds))
        runs.append(without_hdr_steps(lambda: photos_per_s(photos, rounds)))
    return [statistics.median(runs[0::2]), statistics.median(runs[1::2])]


def step_cost_us(photos: list[bytes]) -> float:
    """CPU µs per SDR photo of the HDR steps themselves (gain-map check, drop, one field list
    per rendition), timed alone: free of the machine's noise that whole renders carry."""
    headers = [pyvips.Image.new_from_buffer(p, "", access="sequential") for p in photos]
    start = time.process_time()
    for _ in range(200):
        for header in headers:
            gainmap.check(header, MAX_PIXELS)
            gainmap.drop(header)
            for _ in SPECS:
                gainmap.carries(header)
    return (time.process_time() - start) / 200 / len(headers) * 1e6


def render_ms(photos: list[bytes]) -> float:
    start = time.process_time()
    for data in photos:
        pipeline.render(data, SPECS, MAX_PIXELS)
    return (time.process_time() - start) / len(photos) * 1e3


def report(source: str, count: int, rounds: int, photos: list[bytes]) -> str:
    quarter, full = byte_rows(photos, 4), byte_rows(photos, 1)
    hdr = [ultra_hdr(p, scale=4) for p in photos]
    hdr_rate, sdr_of_hdr = (
        photos_per_s(hdr, rounds),
        photos_per_s([u[: secondary_at(u)] for u in hdr], rounds),
    )
    with_steps, without = sdr_rows(photos, rounds)
    steps_us, per_photo_ms = step_cost_us(photos), render_ms(photos)
    lines = [
        "## HDR gain maps (bench/hdr.py)",
        "",
        f"- {machine()}",
        f"- input: {count} JPEGs from `{source}`, each made into a gain-map JPEG by "
        "tests/hdrcraft.py (uhdrsave, highlights up to 4×); renditions at quality 82",
        "",
        "### Bytes of a JPEG rendition with its gain map ÷ the SDR-only rendition",
        "",
        "| rendition | map ¼ size (phone): median | worst | best "
        "| map full size (Lightroom): median | worst | best |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, q_med, q_max, q_min), (_, f_med, f_max, f_min) in zip(quarter, full, strict=True):
        lines.append(
            f"| {name} | {q_med:.3f} | {q_max:.3f} | {q_min:.3f} "
            f"| {f_med:.3f} | {f_max:.3f} | {f_min:.3f} |"
        )
    lines += [
        "",
        "### Render time (default renditions, one thread, photos/s)",
        "",
        "| input | photos/s |",
        "|---|---:|",
        f"| gain-map JPEGs (¼ map) | {hdr_rate:.2f} |",
        f"| the same JPEGs without their map | {sdr_of_hdr:.2f} |",
        f"| SDR corpus JPEGs, with the HDR steps (median of 3) | {with_steps:.2f} |",
        f"| SDR corpus JPEGs, HDR steps as no-ops (median of 3) | {without:.2f} |",
        "",
        f"The HDR steps cost an SDR photo {steps_us:.0f} µs of CPU, timed alone, against "
        f"{per_photo_ms:.0f} ms of CPU for its render ({steps_us / per_photo_ms / 1e3:.3%}); "
        f"whole renders with and without them differ by {with_steps / without - 1:+.1%}, "
        "which is this shared machine's noise (the order of the runs alternates).",
    ]
    return "\n".join(lines)


def figure(photo: bytes, path: Path) -> None:
    """Three panels of one photo's 1024 px JPEG rendition: its SDR base, its gain map, and
    the map applied (uhdr2scRGB) shown 2 stops darker, so the recovered highlights show."""
    uhdr = ultra_hdr(photo, scale=4)
    [jpeg] = pipeline.render(uhdr, parse_renditions("m:640:jpeg:90"), MAX_PIXELS).renditions
    base = pyvips.Image.new_from_buffer(jpeg.data, "")
    gain = base.get_gainmap().resize(base.width / base.get_gainmap().width)
    gain = gain.crop(0, 0, base.width, base.height).colourspace("srgb")
    applied = (base.uhdr2scRGB() / 4).copy(interpretation="scrgb")
    darker = base.colourspace("scrgb").linear(0.25, 0).copy(interpretation="scrgb")
    panels = [base, gain, darker.colourspace("srgb"), applied.colourspace("srgb")]
    sheet = pyvips.Image.arrayjoin([p.cast("uchar") for p in panels], across=2, shim=8)
    path.write_bytes(bytes(sheet.jpegsave_buffer(Q=85, keep=0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--figure", type=Path, help="write docs/hdr-figure.jpg and stop")
    args = parser.parse_args()
    if args.figure:
        figure(corpus()[1][0].parent.joinpath("Landscape_3.jpg").read_bytes(), args.figure)
        return
    source, paths = corpus()
    photos = [p.read_bytes() for p in paths[: args.photos]]
    body = report(source, len(photos), args.rounds, photos)
    print(body)
    if args.out:
        write_section(args.out, "hdr", body)


if __name__ == "__main__":
    main()
