"""Canon CR3 (ISO-BMFF with the `crx ` brand): where the camera keeps its preview and its EXIF,
as LibRaw and exiftool read them. A top-level `uuid` box (eaf42b5e-...) holds `PRVW`, the
camera's JPEG rendering (1620×1080 on an EOS R6); the `uuid` box (85c0b687-...) in `moov` holds
`CMT1` (IFD0 as a TIFF: make, model, orientation) and `CMT2` (the EXIF IFD as a TIFF: capture
time, exposure). Pure: bytes in; a structure it cannot follow gives no preview and no EXIF,
and LibRaw, which reads the same file, says what is wrong with it.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator
from typing import Any

from darkroom.errors import CorruptImageError
from darkroom.image import isobmff

PREVIEW_UUID = bytes.fromhex("eaf42b5e1c984b88b9fbb7dc406e4d16")
CANON_UUID = bytes.fromhex("85c0b687820f11e08111f4ce462b6a48")
# A PRVW payload: 4 bytes unknown, 2 unknown, width, height, 2 unknown, the JPEG's length
_PRVW_HEADER = ">IHHHHI"
# The preview uuid box: its 16-byte id, then 8 bytes before its first child box
_PREVIEW_CHILDREN = 24
# A CMT box longer than this is no camera's IFD (an R6's are 0.5–14 KB): not read
MAX_TIFF_BYTES = 1024 * 1024


def previews(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of the camera's preview JPEG in the file; none if it has none."""
    try:
        for kind, body, end in _boxes(data, 0, len(data), top_level=True):
            if kind == b"uuid" and data[body : body + 16] == PREVIEW_UUID:
                return list(_prvw(data, body + _PREVIEW_CHILDREN, end))
    except (CorruptImageError, struct.error):
        pass
    return []


def _prvw(data: bytes, start: int, end: int) -> Iterator[tuple[int, int]]:
    for kind, body, stop in _boxes(data, start, end):
        if kind == b"PRVW" and stop - body >= struct.calcsize(_PRVW_HEADER):
            length = struct.unpack_from(_PRVW_HEADER, data, body)[-1]
            jpeg = body + struct.calcsize(_PRVW_HEADER)
            yield jpeg, min(length, stop - jpeg)


def exif(data: bytes) -> bytes | None:
    """IFD0 (CMT1) with the EXIF IFD (CMT2) as its sub-IFD: one TIFF, as image/exif.py reads
    a TIFF-based RAW's; None when the file has neither, or they do not read (no facts then,
    as for any photo's damaged EXIF)."""
    found = _canon_boxes(data)
    main = _tags(found.get(b"CMT1"))
    if main is None:
        return None
    sub = _tags(found.get(b"CMT2"))
    try:
        if sub is not None:
            main[0x8769] = dict(sub)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bytes(main.tobytes())
    except Exception:  # a hostile block may break the writer anywhere
        return None


def orientation(data: bytes) -> int:
    """IFD0's Orientation (CMT1), 1 when absent or unreadable."""
    tags = _tags(_canon_boxes(data).get(b"CMT1"))
    try:
        value = int(tags.get(0x0112, 1)) if tags is not None else 1
    except (TypeError, ValueError):
        return 1
    return value if 1 <= value <= 8 else 1


def _tags(tiff: bytes | None) -> Any:
    """A CMT box's IFD as Pillow reads it (warnings of damage silenced: damage is no facts);
    None when absent or unreadable."""
    if not tiff:
        return None
    from PIL import Image  # as image/exif.py: only a CR3's render maps Pillow in

    tags = Image.Exif()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tags.load(tiff)
            dict(tags)  # reads the entries now, inside the guard
    except Exception:  # a hostile block may break the reader anywhere
        return None
    return tags


def _canon_boxes(data: bytes) -> dict[bytes, bytes]:
    """The children of Canon's uuid box in `moov` (CMT1..4, THMB), by type."""
    try:
        for kind, body, end in _boxes(data, 0, len(data), top_level=True):
            if kind != b"moov":
                continue
            for inner, start, stop in _boxes(data, body, end):
                if inner == b"uuid" and data[start : start + 16] == CANON_UUID:
                    boxes = _boxes(data, start + 16, stop)
                    return {k: data[b:e] for k, b, e in boxes if e - b <= MAX_TIFF_BYTES}
    except (CorruptImageError, struct.error):
        pass
    return {}


def _boxes(
    data: bytes, start: int, end: int, *, top_level: bool = False
) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, end) of each box in data[start:end]."""
    view = memoryview(data)[:end]
    for kind, _, body, stop in isobmff.spans(view, start, top_level=top_level):  # type: ignore[arg-type]
        yield bytes(kind), body, stop
