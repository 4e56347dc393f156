"""Bytes and quality: today's fixed qualities against q=auto, on real camera photos.

Renders each photo with the default renditions and with the same list at q=auto, and reports
total rendition bytes, the lowest SSIMULACRA2 over the set (the reference metric, from the
`bench` group) and CPU seconds per photo. `--calibrate` instead prints the (SSIM loss,
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
from darkroom.image import pipeline, quality
from darkroom.settings import DEFAULT_RENDITIONS, parse_renditions


def targeted(option: str = "q=auto", jpeg_option: str | None = None) -> str:
    """The default list with its fixed qualities replaced by a target (JPEG's may differ)."""
    items = [item.rsplit(":", 1)[0] for item in DEFAULT_RENDITIONS.split(",")]
    return ",".join(f"{i}:{jpeg_option if jpeg_option and ':jpeg' in i else option}" for i in items)


# Distinct scenes of the team corpus (the Landscape_N files are one photo turned).
SCENES = ("42_IndexError", "HMD_Nokia", "iphone_hdr_NO", "orientation-issue-1", "Landscape_1",
          "jpg-24bit-icc-adobe-rgb")  # fmt: skip


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


def scored(data: bytes, renditions: list[pipeline.Rendered]) -> float:
    """The lowest SSIMULACRA2 of the renditions up to 1024 px (2048 is too slow to score in
    NumPy on a shared machine), each against a lossless PNG rendition of the same size
    (the same decode, colour conversion and resize)."""
    small = [r for r in renditions if max(r.width, r.height) <= 1024]
    text = ",".join(f"r{i}:{max(r.width, r.height)}:png" for i, r in enumerate(small))
    references = pipeline.render(data, parse_renditions(text), 100_000_000).renditions
    lowest = 100.0
    for r, reference in zip(small, references, strict=True):
        lowest = min(
            lowest, float(compute_ssimulacra2(io.BytesIO(reference.data), io.BytesIO(r.data)))
        )
    return lowest


def compare(photos: list[Path], auto: str) -> str:
    rows, totals = [], {"fixed": [0, 0.0, 100.0], "auto": [0, 0.0, 100.0]}
    for path in photos:
        data, line = path.read_bytes(), [path.name]
        for label, text in (("fixed", DEFAULT_RENDITIONS), ("auto", auto)):
            renditions, cpu = rendered(data, text)
            size, low = sum(len(r.data) for r in renditions), scored(data, renditions)
            chosen = "/".join(str(r.quality) for r in renditions) if label == "auto" else ""
            total = totals[label]
            total[0], total[1], total[2] = total[0] + size, total[1] + cpu, min(total[2], low)
            line += [f"{size / 1024:.0f}", f"{low:.1f}", f"{cpu:.2f}"] + (
                [chosen] if chosen else []
            )
        rows.append("| " + " | ".join(line) + " |")
        print(rows[-1], file=sys.stderr)
    return _table(rows, totals, len(photos))


def _table(rows: list[str], totals: dict[str, list], count: int) -> str:
    fixed, auto = totals["fixed"], totals["auto"]
    head = ("| photo | fixed KiB | fixed worst S2 | fixed CPU s | auto KiB | auto worst S2 "
            "| auto CPU s | auto qualities |\n|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    summary = (
        f"\nTotal bytes {fixed[0] / 1024:.0f} KiB fixed, {auto[0] / 1024:.0f} KiB auto "
        f"({100 * (1 - auto[0] / fixed[0]):.1f} % less); worst SSIMULACRA2 {fixed[2]:.1f} "
        f"fixed, {auto[2]:.1f} auto; CPU {fixed[1] / count:.2f} s/photo fixed, "
        f"{auto[1] / count:.2f} s/photo auto ({auto[1] / fixed[1]:.2f}x)."
    )
    return "\n".join([head, *rows]) + "\n" + summary


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
    parser.add_argument("--scores", help="WEBP,JPEG targets instead of q=auto's, e.g. 65,70")
    args = parser.parse_args()
    pyvips.concurrency_set(1)
    name, photos = corpus()
    photos = [p for p in photos if p.stem.startswith(SCENES)][: args.limit] or photos[: args.limit]
    if args.calibrate:
        print(calibrate(photos))
        return
    webp, _, jpeg = (args.scores or "").partition(",")
    auto = targeted(f"score={webp}", f"score={jpeg}") if args.scores else targeted()
    body = (
        f"## Bytes and quality\n\n{machine()}; {name}, {len(photos)} photos; one libvips "
        f"thread; CPU is user+system seconds of this process (the machine was shared: "
        f"load changes CPU seconds less than wall time, but not nothing). Targets: {auto}"
        f"\n\n{compare(photos, auto)}"
    )
    print(body)
    if args.out:
        write_section(args.out, "quality", body)


if __name__ == "__main__":
    main()
