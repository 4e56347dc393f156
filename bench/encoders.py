"""Encoder settings by measurement: speed, bytes and SSIMULACRA2 for each libvips option set.

    .venv/bin/python bench/encoders.py [--out docs/benchmarks.md] [--repeat 3]

For every corpus photo libvips can decode, the renditions' pixels are made once (sRGB, 8-bit,
flattened on white) at 320, 1024 and 2048 px; each option set encodes them `--repeat` times
(the fastest CPU time counts, libvips on one thread), and the output is scored against the
pixels it was made from with SSIMULACRA2 (0-100, higher is better; ~90 is visually lossless
at 1:1, ~70 high quality) at 320 and 1024 px. The rule for a default: a change is taken only
at equal quality (mean score within SCORE_TOLERANCE of today's and no rendition more than
PHOTO_TOLERANCE worse) and at most +5 % bytes; among those, the least CPU wins.
Needs the `bench` extra (ssimulacra2, a NumPy port of the libjxl metric).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyvips
from report import corpus, machine, write_section
from ssimulacra2 import compute_ssimulacra2

SIZES = (2048, 1024, 320)
SCORED = (1024, 320)
SCORE_TOLERANCE = 0.5  # SSIMULACRA2 points, mean over the corpus
PHOTO_TOLERANCE = 2.0  # no single rendition (photo, size) may lose more than this
BYTES_TOLERANCE = 1.05
MIN_SAVING = 0.10  # a change must save at least this share of CPU time
SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".avif")


@dataclass(frozen=True)
class Option:
    fmt: str
    label: str
    kwargs: dict[str, Any] = field(hash=False)
    current: bool = False


def options() -> list[Option]:
    webp = [
        Option("webp", f"effort {e}{', smart_subsample' if s else ''}",
               {"Q": 80, "effort": e, "smart_subsample": s}, current=(e, s) == (2, False))
        for e in range(7) for s in (False, True)
    ]  # fmt: skip
    base = {"Q": 82, "interlace": True}
    jpeg = [
        Option("jpeg", "optimize_coding", base | {"optimize_coding": True}, current=True),
        Option("jpeg", "no optimize_coding", base),
        Option("jpeg", "trellis_quant", base | {"optimize_coding": True, "trellis_quant": True}),
        Option("jpeg", "trellis_quant + overshoot_deringing + optimize_scans",
               base | {"optimize_coding": True, "trellis_quant": True,
                       "overshoot_deringing": True, "optimize_scans": True}),
        Option("jpeg", "trellis_quant at Q 84",
               base | {"Q": 84, "optimize_coding": True, "trellis_quant": True}),
        Option("jpeg", "trellis_quant at Q 86",
               base | {"Q": 86, "optimize_coding": True, "trellis_quant": True}),
    ]  # fmt: skip
    return webp + jpeg


def pixels(data: bytes) -> dict[int, pyvips.Image]:
    """Each rendition size as the pipeline hands it to the encoder (alpha flattened)."""
    out = {}
    for size in SIZES:
        image = pyvips.Image.thumbnail_buffer(
            data, size, height=size, size="down", export_profile="srgb"
        )
        if image.hasalpha():
            image = image.flatten(background=[255.0] * (image.bands - 1))
        out[size] = image.cast("uchar").copy_memory()
    return out


def encode(image: pyvips.Image, option: Option, repeat: int) -> tuple[bytes, float]:
    save = image.webpsave_buffer if option.fmt == "webp" else image.jpegsave_buffer
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        out = save(keep=0, **option.kwargs)
        best = min(best, time.process_time() - started)
    return bytes(out), best * 1000


def score(reference: bytes, encoded: bytes) -> float:
    return float(compute_ssimulacra2(io.BytesIO(reference), io.BytesIO(encoded)))


Row = dict[str, Any]


def measure(photos: list[Path], repeat: int) -> dict[Option, Row]:
    rows: dict[Option, Row] = defaultdict(lambda: {"ms": 0.0, "bytes": 0, "scores": []})
    for path in photos:
        try:
            images = pixels(path.read_bytes())
        except pyvips.Error:
            print(f"  skipped {path.name}: libvips cannot decode it here", file=sys.stderr)
            continue
        refs = {s: bytes(images[s].pngsave_buffer(compression=1)) for s in SCORED}
        for option in options():
            row = rows[option]
            for size, image in images.items():
                if option.fmt == "jpeg" and size != 1024:
                    continue  # the one JPEG rendition is medium
                out, ms = encode(image, option, repeat)
                row["ms"] += ms
                row["bytes"] += len(out)
                if size in SCORED:
                    row["scores"].append(score(refs[size], out))
        print(f"  {path.name}", file=sys.stderr)
    return rows


def verdicts(rows: dict[Option, Row]) -> dict[Option, str]:
    out = {}
    for fmt in ("webp", "jpeg"):
        [now] = [o for o in rows if o.fmt == fmt and o.current]
        base = rows[now]
        for option in (o for o in rows if o.fmt == fmt):
            row = rows[option]
            drop = max(b - a for a, b in zip(row["scores"], base["scores"], strict=True))
            mean_delta = _mean(row["scores"]) - _mean(base["scores"])
            ok = (mean_delta >= -SCORE_TOLERANCE and drop <= PHOTO_TOLERANCE
                  and row["bytes"] <= base["bytes"] * BYTES_TOLERANCE)  # fmt: skip
            row |= {"drop": drop, "delta": mean_delta, "ok": ok}
        fastest = min(
            (o for o in rows if o.fmt == fmt and rows[o]["ok"]), key=lambda o: rows[o]["ms"]
        )
        if rows[fastest]["ms"] > base["ms"] * (1 - MIN_SAVING):
            fastest = now  # within noise of today: no change
        for option in (o for o in rows if o.fmt == fmt):
            out[option] = (
                "**chosen**" if option == fastest else ("ok" if rows[option]["ok"] else "")
            )
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(rows: dict[Option, Row], verdict: dict[Option, str]) -> str:
    lines = ["| format | options | CPU ms (sum) | bytes (sum) | bytes vs today | "
             "SSIMULACRA2 mean | vs today | worst rendition vs today | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for fmt in ("webp", "jpeg"):
        [now] = [o for o in rows if o.fmt == fmt and o.current]
        for option in (o for o in rows if o.fmt == fmt):
            r = rows[option]
            label = option.label + (" (darkroom today)" if option.current else "")
            lines.append(
                f"| {fmt} | {label} | {r['ms']:.0f} | {r['bytes']:,} | "
                f"{r['bytes'] / rows[now]['bytes'] - 1:+.1%} | {_mean(r['scores']):.2f} | "
                f"{r['delta']:+.2f} | {-r['drop']:+.2f} | {verdict[option]} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the encoders section of this report")
    parser.add_argument("--repeat", type=int, default=3, help="encodes per option (fastest wins)")
    args = parser.parse_args()
    pyvips.concurrency_set(1)
    pyvips.cache_set_max(0)
    label, photos = corpus(SUFFIXES)
    print(f"{len(photos)} photos from {label}", file=sys.stderr)
    rows = measure(photos, args.repeat)
    verdict = verdicts(rows)
    scored = len(rows[options()[0]]["scores"]) // len(SCORED)
    body = "\n".join([
        "## Encoder settings (bench/encoders.py)", "",
        f"- {machine()}",
        f"- {scored} photos from `{label}` (those libvips decodes here); WebP at 2048, 1024 "
        f"and 320 px, JPEG at 1024 px; CPU time is the fastest of {args.repeat} encodes on "
        "one libvips thread; SSIMULACRA2 (the `ssimulacra2` package) of the 1024 and 320 px "
        "outputs against the pixels they were encoded from",
        f"- rule: equal quality (mean within {SCORE_TOLERANCE} points, no rendition more than "
        f"{PHOTO_TOLERANCE} points worse) and at most +5 % bytes; the least CPU among those "
        "is chosen if it saves at least 10 % CPU, else today's stays", "",
        table(rows, verdict), "",
    ])  # fmt: skip
    print(body)
    if args.out:
        write_section(args.out, "encoders", body)


if __name__ == "__main__":
    main()
