"""Calibration of image/footprint.py: the peak resident memory a render adds, by format and size.

    .venv/bin/python bench/footprint.py

Each photo renders (the default renditions) in a fresh process that has imported the
pipeline and rendered one tiny PNG, with one libvips thread (a render process's count at
concurrency 2 on 2 cores); the figure is its VmHWM after the photo less its VmRSS before,
both with the peak reset. Photos: one camera JPEG resized to 3, 12, 24 and 48 MP and saved
as JPEG, PNG (8 and 16-bit), WebP and AVIF (this libvips has no HEVC encoder), then the
corpus. Prints one row a photo, with footprint.estimate_mb beside the measurement.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyvips
from report import corpus

from darkroom.image import footprint

SIZES_MP = (3, 12, 24, 48)
SAVES = {
    "jpg": {"Q": 90},
    "png": {},
    "webp": {"Q": 80},
    "avif": {"compression": "av1", "Q": 60, "effort": 0},
}
PROBE = r"""
import sys
from darkroom.image import renderproc
from darkroom.image.pipeline import render
from darkroom.settings import Settings
settings = Settings()
render(open(sys.argv[1], "rb").read(), settings.renditions, settings.max_pixels)
data = open(sys.argv[2], "rb").read()
renderproc._reset_peak()
before = renderproc._status_mb("VmRSS")
renderproc._reset_peak()
result = render(data, settings.renditions, settings.max_pixels)
print(before, renderproc._status_mb("VmHWM"), result.facts.width, result.facts.height)
"""


def synthetic(folder: Path) -> list[Path]:
    _, [source, *_] = corpus((".jpg",))
    image = pyvips.Image.new_from_file(str(source)).autorot()
    made = []
    for mp in SIZES_MP:
        resized = image.resize((mp * 1e6 / (image.width * image.height)) ** 0.5)
        for suffix, options in SAVES.items():
            made.append(folder / f"{mp}mp.{suffix}")
            resized.write_to_file(str(made[-1]), **options)
        made.append(folder / f"{mp}mp-16bit.png")
        deep = (resized.cast("ushort") * 256).cast("ushort").copy(interpretation="rgb16")
        deep.write_to_file(str(made[-1]))
    return made


def measure(tiny: Path, photo: Path) -> tuple[int, int, int]:
    """(added MB, width, height) of one render in a fresh process."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", VIPS_CONCURRENCY="1")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny), str(photo)],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    before, peak, width, height = map(int, out.stdout.split())
    return peak - before, width, height


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="darkroom-footprint-") as name:
        folder = Path(name)
        tiny = folder / "tiny.png"
        pyvips.Image.black(64, 48, bands=3).write_to_file(str(tiny))
        _, photos = corpus((".jpg", ".jpeg", ".png", ".webp", ".avif", ".heic"))
        print("| photo | MP | measured MB | estimated MB |\n|---|---:|---:|---:|")
        for photo in synthetic(folder) + photos:
            added, width, height = measure(tiny, photo)
            estimate = footprint.estimate_mb(photo.read_bytes())
            print(f"| {photo.name} | {width * height / 1e6:.1f} | {added} | {estimate} |")


if __name__ == "__main__":
    main()
