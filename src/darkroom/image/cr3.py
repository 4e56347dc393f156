"""Canon CR3 (ISO-BMFF with the `crx ` brand): where the camera keeps its JPEGs and its EXIF,
as LibRaw and exiftool read them. The first track's sample is a JPEG at the camera's own JPEG
size (its `stsz` and `co64` name it); a top-level `uuid` box (eaf42b5e-...) holds `PRVW`, a
1620×1080 JPEG; the `uuid` box (85c0b687-...) in `moov` holds `CMT1` (IFD0 as a TIFF: make,
model, orientation), `CMT2` (the EXIF IFD: capture time, exposure) and `CMT4` (the GPS IFD).
Pure: bytes in; a structure it cannot follow gives no JPEG and no EXIF, and LibRaw, which reads
the same file, says what is wrong with it.
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
# Boxes read at one level at most (a camera's file has about ten): the walk runs on the
# worker's loop for the memory estimate, and a file of millions of 8-byte boxes must not
# hold it for seconds
MAX_BOXES = 256
# A chunk offset box, by the bytes of one entry
_CHUNK_OFFSETS = {b"co64": 8, b"stco": 4}
# The IFDs the CMT boxes hold, by the IFD0 tag that points to each in a TIFF RAW
_SUB_IFDS = {b"CMT2": 0x8769, b"CMT4": 0x8825}


def previews(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of the JPEGs the camera embedded: the first PRVW and the first
    track's first sample (the other tracks hold the sensor data, tens of MB that are no
    JPEG); none if the structure does not read. Each is checked as a JPEG by whoever takes
    it."""
    found: dict[bytes, tuple[int, int]] = {}
    try:
        for kind, body, end in _boxes(data, 0, len(data), top_level=True):
            if kind == b"uuid" and data[body : body + 16] == PREVIEW_UUID:
                span = next(_prvw(data, body + _PREVIEW_CHILDREN, end), None)
            elif kind == b"moov":
                span = _first_track_sample(data, body, end)
            else:
                continue
            if span is not None:
                found.setdefault(kind, span)
    except (CorruptImageError, struct.error):
        pass
    return list(found.values())


def _prvw(data: bytes, start: int, end: int) -> Iterator[tuple[int, int]]:
    for kind, body, stop in _boxes(data, start, end):
        if kind == b"PRVW" and stop - body >= struct.calcsize(_PRVW_HEADER):
            length = struct.unpack_from(_PRVW_HEADER, data, body)[-1]
            jpeg = body + struct.calcsize(_PRVW_HEADER)
            yield jpeg, min(length, stop - jpeg)


def _first_track_sample(data: bytes, start: int, end: int) -> tuple[int, int] | None:
    """The first track's first sample: the camera's full-size JPEG."""
    track = _path(data, start, end, (b"trak", b"mdia", b"minf", b"stbl"))
    return None if track is None else _first_sample(data, *track)


def _path(data: bytes, start: int, end: int, path: tuple[bytes, ...]) -> tuple[int, int] | None:
    """The payload span of the box at `path` below data[start:end]."""
    for kind, body, stop in _boxes(data, start, end):
        if kind == path[0]:
            return (body, stop) if len(path) == 1 else _path(data, body, stop, path[1:])
    return None


def _first_sample(data: bytes, start: int, end: int) -> tuple[int, int] | None:
    """From a sample table: the first sample's size (`stsz`) and offset (`co64` or `stco`)."""
    size = offset = None
    for kind, body, stop in _boxes(data, start, end):
        if kind == b"stsz" and stop - body >= 12:  # version and flags, a size for all, a count
            size, count = struct.unpack_from(">II", data, body + 4)
            if size == 0 and count and stop - body >= 16:
                size = struct.unpack_from(">I", data, body + 12)[0]
        elif kind in _CHUNK_OFFSETS and stop - body >= 8 + _CHUNK_OFFSETS[kind]:
            entries = struct.unpack_from(">I", data, body + 4)[0]
            wide = kind == b"co64"
            offset = (
                struct.unpack_from(">Q" if wide else ">I", data, body + 8)[0] if entries else None
            )
    return (offset, size) if size and offset is not None else None


def exif(data: bytes) -> bytes | None:
    """IFD0 (CMT1) with the EXIF IFD (CMT2) and the GPS IFD (CMT4) as its sub-IFDs: one TIFF,
    as image/exif.py reads a TIFF-based RAW's; None when the file has no IFD0, or it does not
    read (no facts then, as for any photo's damaged EXIF)."""
    found = _canon_boxes(data)
    main = _tags(found.get(b"CMT1"))
    if main is None:
        return None
    try:
        for box, tag in _SUB_IFDS.items():
            sub = _tags(found.get(box))
            if sub is not None:
                main[tag] = dict(sub)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bytes(main.tobytes())
    except Exception:  # a hostile block may break the writer anywhere
        return None


def ifd0(data: bytes) -> bytes | None:
    """CMT1: IFD0 as a TIFF (make, model, orientation); None when the file has none."""
    return _canon_boxes(data).get(b"CMT1")


def _tags(tiff: bytes | None) -> Any:
    """A CMT box's IFD as Pillow reads it (warnings of damage silenced: damage is no facts);
    None when absent or unreadable."""
    if not tiff:
        return None
    from PIL import Image  # as image/exif.py: only a render that reads EXIF maps Pillow in

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
    """The children of Canon's uuid box in `moov` (CMT1..4, THMB), the first of each type."""
    found: dict[bytes, bytes] = {}
    try:
        for kind, body, end in _boxes(data, 0, len(data), top_level=True):
            if kind != b"moov":
                continue
            for inner, start, stop in _boxes(data, body, end):
                if inner == b"uuid" and data[start : start + 16] == CANON_UUID:
                    for k, b, e in _boxes(data, start + 16, stop):
                        if e - b <= MAX_TIFF_BYTES:
                            found.setdefault(k, data[b:e])
                    return found
    except (CorruptImageError, struct.error):
        pass
    return found


def _boxes(
    data: bytes, start: int, end: int, *, top_level: bool = False
) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, end) of each box in data[start:end], MAX_BOXES at most."""
    view = memoryview(data)[:end]
    spans = isobmff.spans(view, start, top_level=top_level)  # type: ignore[arg-type]
    for count, (kind, _, body, stop) in enumerate(spans):
        if count == MAX_BOXES:
            raise CorruptImageError(f"CR3: over {MAX_BOXES} boxes at one level")
        yield bytes(kind), body, stop
