"""Encoding one rendition's pixels in its format, with the settings the bench chose.

Pure libvips, like the pipeline that calls it. Every output carries no metadata at all.
"""

from __future__ import annotations

import pyvips

from darkroom.image import gainmap
from darkroom.settings import DEFAULT_QUALITY, RenditionSpec

_KEEP_NONE = 0  # ForeignKeep.NONE: no EXIF, XMP, IPTC, ICC or other metadata in outputs
# AVIF (libaom through libheif): effort 4, 8-bit 4:2:0, chosen by bench/avif.py at equal
# SSIMULACRA2 against JPEG 82: the one setting measured ≥ 30 % smaller (effort 2: 24 %,
# 4:4:4 or 10-bit at effort 2: 26 %). Its CPU (2.3 s a 1024 px photo) is why AVIF is
# deferred off the first publish (docs/photos.md "Modern formats with a fallback").
AVIF_EFFORT = 4
AVIF_QUALITY = DEFAULT_QUALITY["avif"]
# WebP effort 2 (libvips' default is 4): half the CPU at equal SSIMULACRA2, +3 % bytes
# (docs/benchmarks.md, bench/encoders.py)
WEBP_EFFORT = 2


def save(image: pyvips.Image, spec: RenditionSpec) -> bytes:
    """The rendition's bytes at `spec.quality` (JPEG flattened on white)."""
    if spec.format == "webp":
        return bytes(image.webpsave_buffer(Q=spec.quality, effort=WEBP_EFFORT, keep=_KEEP_NONE))
    if spec.format == "avif":
        return bytes(
            image.heifsave_buffer(
                Q=spec.quality, compression="av1", effort=AVIF_EFFORT, keep=_KEEP_NONE
            )
        )
    if spec.format == "png":
        return bytes(image.pngsave_buffer(keep=_KEEP_NONE))
    if image.hasalpha():
        image = image.flatten(background=[255.0] * (image.bands - 1))
    if gainmap.carries(image):
        return gainmap.save_jpeg(image, spec.quality)
    return bytes(
        image.jpegsave_buffer(Q=spec.quality, interlace=True, optimize_coding=True, keep=_KEEP_NONE)
    )
