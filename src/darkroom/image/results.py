"""What a render hands back: the original's header facts (Source), the facts a gallery shows
before the pixels arrive (Facts), each encoded rendition (Rendered) and the whole result
(RenderResult), which the render process sends to the worker down its pipe.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pyvips

from darkroom.image import exif
from darkroom.image.stagetimes import Stage


class Source(msgspec.Struct, frozen=True):
    """What the header says: format, upright size, frames, embedded profile and EXIF."""

    format: str
    width: int
    height: int
    frames: int = 1
    icc: bytes | None = None
    exif: bytes | None = None
    hdr: str | None = None


# The decoded pixels, ready for the renditions, and what the header said
Decoded = tuple[pyvips.Image, Source]


class Facts(msgspec.Struct, frozen=True):
    """What the original is and what a gallery shows before the pixels arrive."""

    format: str
    width: int
    height: int
    has_alpha: bool = False  # some pixel is not fully opaque
    frames: int = 1
    source_profile: str | None = None
    thumbhash: str | None = None
    dominant_color: str | None = None
    focal_x: float | None = None  # where crop=attention centres a box, 0..1 of the width
    focal_y: float | None = None
    capture: exif.Capture = msgspec.field(default_factory=exif.Capture)
    hdr: str | None = None  # gainmap, pq, hlg: what an HDR display could show (docs/hdr.md)
    original_sha256: str = ""  # of exactly the bytes rendered, hashed in the render process

    def row(self, size: int, *, keep_location: bool) -> dict[str, Any]:
        """The `photos` columns; location only when the operator chose to keep it."""
        row = {**msgspec.structs.asdict(self), **msgspec.structs.asdict(self.capture)}
        del row["capture"]
        if not keep_location:
            row["latitude"] = row["longitude"] = None
        return {**row, "bytes": size}


class Rendered(msgspec.Struct, frozen=True):
    name: str
    format: str
    ext: str
    width: int
    height: int
    data: bytes
    sha256: str  # of `data`, hashed here in the render process (names its storage key)
    crop: str | None = None  # a box's crop: attention or centre
    quality: int = 0  # the encoder's, fixed or chosen for a target (image/quality.py)
    score: float | None = None  # the calibrated score a target's choice reached


class RenderResult(msgspec.Struct, frozen=True):
    facts: Facts
    renditions: list[Rendered]
    peak_rss_mb: int = 0  # filled in by the render process that made it
    stages: list[Stage] = msgspec.field(default_factory=list)  # when asked (a traced photo)
