"""What a gallery paints before the first rendition arrives: a ThumbHash and the dominant
colour, from small RGBA images (at most 100×100 px) cascaded from the decode.

Pure: pixels in, text out. The dominant colour is the colour covering the largest area
(a histogram of coarse colour boxes, alpha-weighted, then the mean of the fullest box),
not the mean of the photo: a red boat on blue water is blue.
"""

from __future__ import annotations

import base64

from darkroom.image import thumbhash

SIDE = thumbhash.MAX_SIDE  # the dominant colour's image
# The ThumbHash's own image, cascaded from that one. A hash holds at most 7 terms along an
# edge, so 48 px already gives the same bytes as 100 px on the test photos (a term or two
# differs by one step on some), at a quarter of the pure-Python CPU (about 2 ms, not 9).
THUMBHASH_SIDE = 48
_BITS = 3  # 8 levels per channel: 512 boxes, each 32 levels wide
_OPAQUE_ENOUGH = 128  # mostly transparent pixels do not count towards the area


def thumbhash_text(w: int, h: int, rgba: bytes) -> str:
    """Standard base64 of the ThumbHash bytes."""
    return base64.b64encode(thumbhash.encode(w, h, rgba)).decode("ascii")


def dominant_color(rgba: bytes) -> tuple[str, float] | None:
    """`#rrggbb` of the colour covering the largest area, and its share of the visible
    pixels; None when nothing is visible."""
    counts: dict[int, list[int]] = {}
    visible = 0
    shift = 8 - _BITS
    for i in range(0, len(rgba), 4):
        if rgba[i + 3] < _OPAQUE_ENOUGH:
            continue
        r, g, b = rgba[i], rgba[i + 1], rgba[i + 2]
        box = counts.setdefault((r >> shift) << 2 * _BITS | (g >> shift) << _BITS | b >> shift,
                                [0, 0, 0, 0])  # fmt: skip
        box[0] += 1
        box[1] += r
        box[2] += g
        box[3] += b
        visible += 1
    if not visible:
        return None
    n, r, g, b = max(counts.values())
    return f"#{round(r / n):02x}{round(g / n):02x}{round(b / n):02x}", n / visible
