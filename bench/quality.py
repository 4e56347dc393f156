"""Bytes and quality: today's fixed qualities against q=auto, on real camera photos.

Renders each photo with the default renditions and with the same list at q=auto, and reports
side by side total rendition bytes, the lowest SSIMULACRA2 over the set (the reference
metric, from the `bench` group; also the lowest over the renditions q=auto may lower, at
least MIN_RELATIVE px) and CPU seconds per photo. `--rules FLOOR,SLOPE,MAX;...` adds a row
per q=auto rule, for the trade-off table. `--calibrate` instead prints the (SSIM loss,
SSIMULACRA2) pairs and the least-squares fit image/quality.py maps its score with.
Needs the `bench` group (ssimulacra2).
"""

from __future__ import annotations

import argparse
import io
import math
import resource
import sys
from pathlib import Path

import pyvips
from report import corpus, machine, write_section
from ssimulacra2 import compute_ssimulacra2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from darkroom import settings
from darkroom.image import pipeline, quality
from darkroom.settings import DEFAULT_RENDITIONS, parse_renditions


def targeted(option: str = "q=auto", jpeg_option: str | None = None) -> str:
    """The default list with its fixed qualities replaced by a target (JPEG's may differ)."""
    items = [item.rsplit(":", 1)[0] for item in DEFAULT_RENDITIONS.split(",")]
    return ",".join(f"{i}:{jpeg_option if jpeg_option and ':jpeg' in i else option}" for i in items)


# Every distinct camera photo of the team corpus (the Landscape_N files are one photo turned;
# png-alpha-64bit is a cut-out on transparency, animated-loop-3 a drawing).
SCENES = ("42_IndexError", "HMD_Nokia", "iphone_hdr_NO", "orientation-issue-1", "Landscape_1",
          "jpg-24bit-icc-adobe-rgb", "Channel_digital_image_CMYK_color", "embedgravitybird", "4",
          "avif-orientation-6", "iphone_13_pro_max")  # fmt: skip
SUFFIXES = (".jpg", ".png", ".webp", ".avif", ".heic")


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reference_metric(reference: pyvips.Image, data: bytes) -> float:
    """SSIMULACRA2 of an encode against the pixels it encoded."""
    original = io.BytesIO(bytes(reference.pngsave_buffer(compression=1)))
    return float(compute_ssimulacra2(original, io.BytesIO(data)))


def rendered(data: bytes, text: str) -> tuple[list[pipeline.Rendered], float]:
    specs = parse_renditions(text)
    start = cpu_s()
    result = pipeline.render(data, specs, 100_000_000)
    return result.renditions, cpu_s() - start


def scored(data: bytes, renditions: list[pipeline.Rendered]) -> tuple[float, float]:
    """The lowest SSIMULACRA2 of the renditions up to 1024 px (2048 is too slow to score in
    NumPy on a shared machine), each against a lossless PNG rendition of the same size
    (the same decode, colour conversion and resize); and the lowest of those at least
    MIN_RELATIVE px (the ones q=auto may lower)."""
    small = [r for r in renditions if max(r.width, r.height) <= 1024]
    text = ",".join(f"r{i}:{max(r.width, r.height)}:png" for i, r in enumerate(small))
    references = pipeline.render(data, parse_renditions(text), 100_000_000).renditions
    lowest, large = 100.0, 100.0
    for r, reference in zip(small, references, strict=True):
        s2 = float(compute_ssimulacra2(io.BytesIO(reference.data), io.BytesIO(r.data)))
        lowest = min(lowest, s2)
        if max(r.width, r.height) >= quality.MIN_RELATIVE:
            large = min(large, s2)
    return lowest, large


def auto_list(rule: str) -> str:
    """The default list at q=auto under a rule FLOOR,SLOPE,MAX (set on the modules: the
    floor is q=auto's target, read when the list is parsed)."""
    floor, slope, most = (float(x) for x in rule.split(","))
    settings.AUTO_TARGET.update(dict.fromkeys(settings.AUTO_TARGET, floor))
    quality.SLOPE, quality.MAX_DROP = slope, most
    return targeted()


def compare(photos: list[Path], rules: list[str]) -> str:
    """Per photo, the fixed list and each rule one after the other (side by side in time:
    the machine's load shifts all of them alike); totals per label."""
    labels = ["fixed", *rules]
    totals = {label: [0, 0.0, 100.0, 100.0] for label in labels}
    rows = []
    for path in photos:
        data, line = path.read_bytes(), [path.name]
        for label in labels:
            text = DEFAULT_RENDITIONS if label == "fixed" else auto_list(label)
            renditions, cpu = rendered(data, text)
            size, (low, large) = sum(len(r.data) for r in renditions), scored(data, renditions)
            t = totals[label]
            t[0], t[1], t[2], t[3] = t[0] + size, t[1] + cpu, min(t[2], low), min(t[3], large)
            chosen = "/".join(str(r.quality) for r in renditions)
            line += [f"{size / 1024:.0f} KiB, S2 {low:.1f}/{large:.1f}, {cpu:.2f} s, q {chosen}"]
        rows.append("| " + " | ".join(line) + " |")
        print(rows[-1], file=sys.stderr)
    return _table(rows, totals, len(photos))


def _table(rows: list[str], totals: dict[str, list], count: int) -> str:
    labels = list(totals)
    head = "| photo | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels)
    fixed = totals["fixed"]
    summary = ["", "| list | total KiB | vs fixed | lowest S2 | lowest S2 ≥ "
               f"{quality.MIN_RELATIVE} px | CPU s/photo | CPU vs fixed |",
               "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, (size, cpu, low, large) in totals.items():
        name = "fixed" if label == "fixed" else f"q=auto {label}"
        summary.append(
            f"| {name} | {size / 1024:.0f} | {100 * (size / fixed[0] - 1):+.1f} % | {low:.1f} "
            f"| {large:.1f} | {cpu / count:.3f} | {cpu / fixed[1]:.2f}x |"
        )
    return "\n".join([head, *rows, *summary])


def calibrate(photos: list[Path]) -> str:
    """(log10 SSIM loss of the sample, SSIMULACRA2 of the full encode) at 1024 px; the fit."""
    pairs = []
    for path in photos:
        image = pyvips.Image.thumbnail_buffer(path.read_bytes(), 1024, size="down")
        image = image.colourspace("srgb").copy_memory()
        for spec in parse_renditions("c:1024:webp,c:1024:jpeg"):
            for q in (40, 60, 75, 90):
                encoded = pipeline._save(image, spec.__class__(**{**_fields(spec), "quality": q}))
                sample = quality.sampled(image)
                small = pipeline._save(sample, spec.__class__(**{**_fields(spec), "quality": q}))
                x = math.log10(
                    quality.loss(quality.luma(sample), quality.luma(quality._decoded(small)))
                )
                pairs.append((x, reference_metric(image, encoded)))
                print(
                    f"{path.name} {spec.format} q={q} {x:.3f} {pairs[-1][1]:.1f}", file=sys.stderr
                )
    n = len(pairs)
    mx, my = sum(p[0] for p in pairs) / n, sum(p[1] for p in pairs) / n
    b = sum((x - mx) * (y - my) for x, y in pairs) / sum((x - mx) ** 2 for x, _ in pairs)
    a = my - b * mx
    residual = max(abs(a + b * x - y) for x, y in pairs)
    rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in pairs) / n)
    return f"FIT_A, FIT_B = {a:.2f}, {b:.2f}  # {n} pairs, rms {rms:.2f}, worst {residual:.2f}"


def _fields(spec: object) -> dict:
    import msgspec

    return msgspec.structs.asdict(spec)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--limit", type=int, default=len(SCENES))
    parser.add_argument("--out", type=Path)
    default = f"{settings.AUTO_TARGET['webp']:g},{quality.SLOPE:g},{quality.MAX_DROP:g}"
    parser.add_argument("--rules", default=default, help="FLOOR,SLOPE,MAX;... q=auto rules")
    args = parser.parse_args()
    pyvips.concurrency_set(1)
    name, photos = corpus(SUFFIXES)
    photos = [p for p in photos if p.stem in SCENES or p.stem.startswith(SCENES[:2])]
    photos = photos[: args.limit]
    if args.calibrate:
        print(calibrate(photos))
        return
    body = (
        f"## Bytes and quality\n\n{machine()}; {name}, {len(photos)} photos; one libvips "
        f"thread; CPU is user+system seconds of this process (the machine was shared: "
        f"load changes CPU seconds less than wall time, but not nothing). q=auto rules are "
        f"FLOOR,SLOPE,MAX (image/quality.py `relative`); per photo: bytes, SSIMULACRA2 "
        f"lowest/lowest at ≥ {quality.MIN_RELATIVE} px, CPU, qualities in the order the "
        f"render returns them (large, medium WebP, medium JPEG, thumb)."
        f"\n\n{compare(photos, args.rules.split(';'))}"
    )
    print(body)
    if args.out:
        write_section(args.out, "quality", body)


if __name__ == "__main__":
    main()
