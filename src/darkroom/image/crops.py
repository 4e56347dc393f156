"""Crops and turns of decoded pixels: box renditions (fitted inside a width×height box or
cropped to fill it, by libvips attention or the centre), the focal point a client that crops
on its own should keep, and a HEIF item's clean aperture, rotation and mirroring. Pure
pixels, as pipeline.py: made from images it already decoded and shrank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyvips

from darkroom.image import isobmff
from darkroom.settings import RenditionSpec

# The focal point is found on an image this small: libvips' attention itself looks at a
# 32 px version, so a larger input only costs its shrink (~0.5 ms of CPU at 256 px).
_FOCAL_SIDE = 256


def decode_edge(specs: Sequence[RenditionSpec], width: int, height: int) -> int:
    """The long edge the decode must keep so that every rendition is a shrink of it: a
    box that is cropped needs the photo to cover it, so up to its aspect ratio longer."""
    edges = [spec.size for spec in specs]
    for spec in specs:
        if spec.box and spec.crop and width and height:
            cover = max(spec.box[0] / width, spec.box[1] / height)
            edges.append(math.ceil(cover * max(width, height)))
    return max(edges)


def source(images: Sequence[pyvips.Image], spec: RenditionSpec) -> pyvips.Image:
    """The smallest of `images` (each a shrink of the one before) a box rendition can be
    shrunk from without enlarging it; the first when none covers the box."""
    width, height = spec.box or (spec.size, spec.size)
    chosen = images[0]
    for image in images:
        fill = max(width / image.width, height / image.height)
        fit = min(width / image.width, height / image.height)
        if (fill if spec.crop else fit) <= 1:
            chosen = image
    return chosen


def boxed(image: pyvips.Image, spec: RenditionSpec) -> pyvips.Image:
    """Fitted inside the box, or filling it exactly with `crop`. Never enlarged: a photo
    smaller than a cropped box gives the largest region of the box's shape it has."""
    width, height = spec.box or (spec.size, spec.size)
    if not spec.crop:
        return image.thumbnail_image(width, height=height, size="down").copy_memory()
    scale = min(1.0, image.width / width, image.height / height)
    width, height = max(1, round(width * scale)), max(1, round(height * scale))
    cropped = image.thumbnail_image(width, height=height, size="down", crop=spec.crop)
    return cropped.copy_memory()


def focal_point(image: pyvips.Image) -> tuple[float, float]:
    """The centre of the square (half the short side) libvips' attention (edges, skin
    tones, saturation) keeps, as (x, y) in 0..1 of the image. The centre of the window,
    not attention's raw peak: the peak may sit on a subject's edge, or on the image's edge
    beside a subject near it, where a client cropping around it would cut the subject."""
    if max(image.width, image.height) > _FOCAL_SIDE:
        image = image.thumbnail_image(_FOCAL_SIDE, height=_FOCAL_SIDE, size="down")
    side = max(1, min(image.width, image.height) // 2)
    _, found = image.smartcrop(
        side, side, interesting="attention", attention_x=True, attention_y=True
    )
    # libvips places its window the same way: centred on the peak, kept inside the image
    left = min(max(found["attention_x"] - side // 2, 0), image.width - side)
    top = min(max(found["attention_y"] - side // 2, 0), image.height - side)
    x, y = (left + side / 2) / image.width, (top + side / 2) / image.height
    return round(x, 4), round(y, 4)


_ROTATIONS = ("d0", "d270", "d180", "d90")  # irot turns anti-clockwise, libvips clockwise


def transformed(image: pyvips.Image, steps: list[isobmff.Step]) -> pyvips.Image:
    """The decoded image with its clean aperture, rotation and mirroring applied in order."""
    for op, args in steps:
        if op == "crop":
            image = image.crop(*args)
        elif op == "rotate":
            image = image.rot(_ROTATIONS[args[0]]) if args[0] else image
        else:
            image = image.flipver() if args[0] == 0 else image.fliphor()
    return image
