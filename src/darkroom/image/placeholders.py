"""What a gallery paints before the first rendition arrives: a ThumbHash and the dominant
colour, from small RGBA images (at most 100×100 px) cascaded from the decode.

Pure: pixels in, text out. The dominant colour is the colour covering the largest area
(a histogram of coarse colour boxes, alpha-weighted, then the mean of the fullest box),
not the mean of the photo: a red boat on blue water is blue.
"""

from __future__ import annotations

import base64

import numpy as np

from darkroom.image import thumbhash

SIDE = thumbhash.MAX_SIDE  # both placeholders are made from one image this small
_BITS = 3  # 8 levels per channel: 512 boxes, each 32 levels wide
_BOXES = 1 << 3 * _BITS
_OPAQUE_ENOUGH = 128  # mostly transparent pixels do not count towards the area


def thumbhash_text(w: int, h: int, rgba: bytes) -> str:
    """Standard base64 of the ThumbHash bytes."""
    return base64.b64encode(thumbhash.encode(w, h, rgba)).decode("ascii")


def dominant_color(rgba: bytes) -> tuple[str, float] | None:
    """`#rrggbb` of the colour covering the largest area, and its share of the visible
    pixels; None when nothing is visible."""
    pixels = np.frombuffer(rgba, np.uint8).reshape(-1, 4)
    coarse = (pixels[:, :3] >> (8 - _BITS)).astype(np.intp)
    boxes = coarse[:, 0] << 2 * _BITS | coarse[:, 1] << _BITS | coarse[:, 2]
    boxes[pixels[:, 3] < _OPAQUE_ENOUGH] = _BOXES  # one more box, for the invisible
    counts = np.bincount(boxes, minlength=_BOXES + 1)[:_BOXES]
    visible = int(counts.sum())
    if not visible:
        return None
    sums = [np.bincount(boxes, pixels[:, c], _BOXES + 1)[:_BOXES] for c in range(3)]
    # The fullest box; ties go to the larger red sum, then green, then blue.
    box = np.lexsort((sums[2], sums[1], sums[0], counts))[-1]
    n = int(counts[box])
    r, g, b = (round(int(total[box]) / n) for total in sums)
    return f"#{r:02x}{g:02x}{b:02x}", n / visible
