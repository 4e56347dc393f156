"""The smart-crop contact sheet of docs/photos.md: each photo with its focal point, beside
its 128 × 128 `crop=attention` and `crop=centre` renditions, as pipeline.render makes them.

    .venv/bin/python bench/crops.py [--out docs/crops.jpg]

Not in `make bench`: it measures nothing, it shows what the crops keep.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyvips
from report import ROOT

from darkroom.image import pipeline
from darkroom.settings import parse_renditions

PHOTOS = ["Landscape_1.jpg", "Landscape_3.jpg", "Landscape_5.jpg", "Landscape_8.jpg",
          "4.webp", "embedgravitybird.png", "png-alpha-64bit.png",
          "iphone_13_pro_max.HEIC"]  # fmt: skip
SPECS = parse_renditions("view:192:png,att:128x128:png:crop=attention,mid:128x128:png:crop=centre")
GAP, MARK = 8, 5  # px between tiles; half the focal point's mark


def opaque(image: pyvips.Image) -> pyvips.Image:
    """Three bands on white, whatever the rendition's bands."""
    image = image.colourspace("srgb")
    return image.flatten(background=[255, 255, 255]) if image.hasalpha() else image


def row(data: bytes) -> pyvips.Image:
    """The photo (192 px long edge) with its focal point marked, then both squares."""
    result = pipeline.render(data, SPECS, 10**9)
    tiles = {r.name: opaque(pyvips.Image.new_from_buffer(r.data, "")) for r in result.renditions}
    view = tiles["view"]
    x = int((result.facts.focal_x or 0.5) * view.width)
    y = int((result.facts.focal_y or 0.5) * view.height)
    for size, colour in ((MARK + 1, [0, 0, 0]), (MARK, [255, 40, 40])):
        view = view.draw_rect(colour, x - size, y - size, 2 * size, 2 * size, fill=True)
    tiles["view"] = view
    joined = tiles["view"].gravity("centre", 192, 192, extend="white")
    for name in ("att", "mid"):
        tile = tiles[name].gravity("centre", tiles[name].width, 192, extend="white")
        joined = joined.join(tile, "horizontal", shim=GAP, background=[255])
    return joined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "crops.jpg")
    args = parser.parse_args()
    rows = [row((ROOT / "tests" / "photos" / name).read_bytes()) for name in PHOTOS]
    sheet = pyvips.Image.arrayjoin(rows, across=2, shim=GAP, background=[255])
    sheet.jpegsave(str(args.out), Q=82, keep=0)
    print(f"{args.out}: {sheet.width} × {sheet.height}")


if __name__ == "__main__":
    main()
