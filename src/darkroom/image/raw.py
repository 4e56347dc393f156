"""Camera RAW originals (DNG, CR2, NEF, ARW, ORF, RW2, RAF, CR3): which kind a file is
from its bytes, and the largest embedded JPEG preview, handed back as a plain JPEG carrying
the RAW's orientation so the JPEG path renders it upright.

Pure: bytes in, bytes out. A preview that covers the largest rendition (or the sensor, when
smaller) is used as it is. Short of that, the sensor data is decoded by LibRaw
(rawdecode.py); where LibRaw cannot be loaded, a smaller preview still serves when it is at
least USABLE_EDGE long (the renditions then stop at its size, as for any small photo), and a
file with no preview that long is `unsupported_format`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import msgspec

from darkroom.errors import CorruptImageError, ImageTooLargeError, UnsupportedFormatError
from darkroom.image import cr3

_TIFF_MAGIC = {b"II*\0": "<", b"MM\0*": ">"}
_VARIANT_MAGIC = {b"IIRO": "orf", b"IIRS": "orf", b"MMOR": "orf", b"IIU\0": "rw2"}
_RAF_MAGIC = b"FUJIFILMCCD-RAW"
_MAKERS = {
    "canon": "cr2",
    "nikon": "nef",
    "sony": "arw",
    "olympus": "orf",
    "om digital": "orf",
    "panasonic": "rw2",
}
KINDS = ("dng", "cr2", "nef", "arw", "orf", "rw2", "raf", "cr3")
MAX_IFDS = 64  # far above any camera's (a NEF has ~6): a loop or a forged chain ends here
MAX_ENTRIES = 1024
# A preview this long is a photo worth showing (the default `medium` rendition's size): real
# ARW and RAF previews are about 1,600-1,920 px, short of a 2,048 px rendition, and refusing
# them would refuse most of those cameras' files outright for want of a decoder.
USABLE_EDGE = 1024
# The sensor's declared size is not decoded (only a preview is, under DARKROOM_MAX_PIXELS):
# it is checked against this many times the budget, so a 102 MP camera's files render from
# their preview while a header claiming 10 gigapixels is still refused as a forgery.
DECLARED_FACTOR = 4
EXIF_PREFIX_BYTES = 4 * 1024 * 1024  # IFD0 and the EXIF IFD sit at the start of a RAW
# A camera's preview names its size within a few segments (APPn, the ICC profile's chunks,
# the tables); a walk past this many is no preview
MAX_SEGMENTS = 128

# TIFF tags
_WIDTH, _HEIGHT, _ORIENTATION, _MAKE = 0x0100, 0x0101, 0x0112, 0x010F
_STRIP_OFFSETS, _STRIP_BYTES, _SUB_IFDS = 0x0111, 0x0117, 0x014A
_JPEG_OFFSET, _JPEG_BYTES, _DNG_VERSION, _RW2_JPEG = 0x0201, 0x0202, 0xC612, 0x002E
_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 13: 4}
_SOF_BASELINE = (0xC0, 0xC1, 0xC2)  # lossless SOF3 (a CR2's or DNG's raw data) is no preview


class Preview(msgspec.Struct, frozen=True):
    """The JPEG to render (orientation set to the RAW's) and the RAW's EXIF for its facts."""

    jpeg: bytes
    width: int
    height: int
    exif: bytes | None


def kind(data: bytes) -> str | None:
    """The RAW kind from magic bytes and IFD0 tags; None for what is no RAW (plain TIFF too)."""
    if data[:15] == _RAF_MAGIC:
        return "raf"
    if data[:4] in _VARIANT_MAGIC:
        return _VARIANT_MAGIC[data[:4]]
    if data[:4] not in _TIFF_MAGIC:
        return None
    if data[8:10] == b"CR":
        return "cr2"
    try:
        tags = _Tiff(data).ifd(_Tiff(data).first())
    except CorruptImageError:
        return None
    if _DNG_VERSION in tags:
        return "dng"
    make = _Tiff(data).text(tags.get(_MAKE)).lower()
    return next((k for maker, k in _MAKERS.items() if make.startswith(maker)), None)


def is_cr3(brands: set[bytes]) -> bool:
    return b"crx " in brands


def preview(data: bytes, fmt: str, needed_edge: int, max_pixels: int, decoder: bool) -> Preview:
    """The largest embedded JPEG preview, after the pixel budget over every image the file
    declares; `unsupported_format` when none covers `needed_edge` (or the sensor, when
    shorter) and a `decoder` can do better, or, without one, when none is USABLE_EDGE long."""
    jpeg, width, height, orientation = _chosen(data, fmt, needed_edge, max_pixels, decoder)
    if fmt == "raf":  # its preview carries the camera's EXIF, orientation included
        return Preview(jpeg, width, height, None)
    return Preview(_oriented(jpeg, orientation), width, height, exif_of(data))


def camera_jpeg(data: bytes, fmt: str, max_pixels: int) -> bytes:
    """The largest embedded preview whatever its size, turned as the RAW is (the camera's own
    rendering of the frame, for image/tones.py); `unsupported_format` when it has none."""
    jpeg, _, _, orientation = _chosen(data, fmt, 1, max_pixels, decoder=True)
    return jpeg if fmt == "raf" else _oriented(jpeg, orientation)


def preview_size(
    data: bytes, fmt: str, needed_edge: int, max_pixels: int, decoder: bool
) -> tuple[int, int]:
    """The size `preview` would hand back, without building it (the budget's estimate)."""
    return _chosen(data, fmt, needed_edge, max_pixels, decoder)[1:3]


def _chosen(
    data: bytes, fmt: str, needed_edge: int, max_pixels: int, decoder: bool
) -> tuple[bytes, int, int, int]:
    """The preview `preview` takes, its size and the RAW's orientation."""
    floor = needed_edge if decoder else USABLE_EDGE
    if fmt == "cr3":  # ISO-BMFF: no IFDs, and its sensor's size is not read here
        found = _largest(data, cr3.previews(data), max_pixels)
        return (*_covering(found, min(needed_edge, floor)), _orientation_of(cr3.ifd0(data)))
    if fmt == "raf":
        return (*_raf(data, min(needed_edge, floor), max_pixels), 1)
    images, previews, orientation = _Tiff(data).walk()
    for width, height in images:  # never decoded here: only a forged size is refused
        _check_pixels(width, height, max_pixels * DECLARED_FACTOR)
    sensor_edge = max((max(w, h) for w, h in images), default=0)
    edge = min(needed_edge, sensor_edge or needed_edge, floor)
    return (*_covering(_largest(data, previews, max_pixels), edge), orientation)


def _orientation_of(ifd0: bytes | None) -> int:
    """The orientation in a lone IFD0 as a TIFF (a CR3's CMT1), 1 when it does not read."""
    if ifd0 is None or ifd0[:4] not in _TIFF_MAGIC:
        return 1
    tiff = _Tiff(ifd0)
    try:
        return tiff.orientation(tiff.ifd(tiff.first()))
    except CorruptImageError:
        return 1


def sensor_size(data: bytes) -> tuple[int, int] | None:
    """The largest image a TIFF-based RAW declares (its sensor's); None for a RAF or CR3."""
    if data[:15] == _RAF_MAGIC or data[:4] not in (*_TIFF_MAGIC, *_VARIANT_MAGIC):
        return None
    images = _Tiff(data).walk()[0]
    return max(images, key=lambda size: size[0] * size[1], default=None)


def half_size(width: int, height: int, needed_edge: int) -> bool:
    """Whether LibRaw's half-size decode (a pixel per 2×2 Bayer cell) still covers what the
    renditions need from a sensor of this size."""
    return max(width, height) // 2 >= needed_edge


def exif_of(data: bytes) -> bytes | None:
    """The EXIF a TIFF-based RAW carries in IFD0 and its EXIF IFD, at its start, as a TIFF
    image/exif.py reads; a RAF's, its preview's APP1; a CR3's, its CMT1, CMT2 and CMT4 boxes."""
    if data[:15] == _RAF_MAGIC:
        return _raf_exif(data)
    if data[4:8] == b"ftyp":
        return cr3.exif(data)
    if data[:4] not in (*_TIFF_MAGIC, *_VARIANT_MAGIC):
        return None
    magic = b"II*\0" if data[:2] == b"II" else b"MM\0*"  # ORF's and RW2's own magic to TIFF's
    return magic + data[4:EXIF_PREFIX_BYTES]


def _raf_exif(data: bytes) -> bytes | None:
    """The `Exif` APP1 of the JPEG the RAF header names (the camera's own EXIF)."""
    if len(data) < 92:
        return None
    offset, length = struct.unpack(">II", data[84:92])
    jpeg, pos = data[offset : offset + length], 2
    while pos + 4 <= len(jpeg) and jpeg[pos] == 0xFF and 0xE0 <= jpeg[pos + 1] <= 0xEF:
        size = int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
        if jpeg[pos + 1] == 0xE1 and jpeg[pos + 4 : pos + 10] == b"Exif\0\0":
            return jpeg[pos + 4 : pos + 2 + size]
        pos += 2 + size
    return None


def _raf(data: bytes, edge: int, max_pixels: int) -> tuple[bytes, int, int]:
    """RAF: a fixed header whose offset 84 names the JPEG preview (with its own EXIF)."""
    if len(data) < 92:
        raise CorruptImageError("RAF header truncated")
    offset, length = struct.unpack(">II", data[84:92])
    return _covering(_largest(data, [(offset, length)], max_pixels), edge)


def _largest(
    data: bytes, spans: list[tuple[int, int]], max_pixels: int
) -> tuple[bytes, int, int] | None:
    """The largest JPEG at `spans` within the pixel budget, only it copied out; None when none
    is a JPEG; `image_too_large` only when every JPEG found is over the budget (a CR3's
    full-size JPEG past a lowered budget leaves its PRVW to serve)."""
    view, best, over = memoryview(data), None, None
    for offset, length in dict.fromkeys(spans):  # each span once, in order
        size = jpeg_size(view[offset : offset + length]) if offset + length <= len(data) else None
        if size is None:
            continue
        if size[0] * size[1] > max_pixels:
            over = over or size
        elif best is None or size[0] * size[1] > best[2] * best[3]:
            best = (offset, length, *size)
    if best is None:
        if over is not None:
            _check_pixels(*over, max_pixels)
        return None
    offset, length, width, height = best
    return data[offset : offset + length], width, height


def _covering(best: tuple[bytes, int, int] | None, edge: int) -> tuple[bytes, int, int]:
    if best is None:
        raise UnsupportedFormatError("RAW without a JPEG preview, and no RAW decoder")
    if max(best[1], best[2]) < edge:
        raise UnsupportedFormatError(
            f"RAW preview {best[1]}x{best[2]} is smaller than the {edge} px needed,"
            " and no RAW decoder"
        )  # the message is for a worker without LibRaw: with it, the decoder takes over
    return best


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"{width}x{height} is {width * height} pixels, over the budget of {max_pixels}"
        )


def jpeg_size(jpeg: bytes | memoryview) -> tuple[int, int] | None:
    """Width and height from a baseline/progressive JPEG's SOF; None for anything else (and
    for a SOF past MAX_SEGMENTS segments: the walk runs on the worker's loop)."""
    if jpeg[:2] != b"\xff\xd8":
        return None
    pos = 2
    for _ in range(MAX_SEGMENTS):
        if not (pos + 9 <= len(jpeg) and jpeg[pos] == 0xFF):
            return None
        marker, length = jpeg[pos + 1], int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
        if length < 2:  # a segment's length counts its own two bytes
            return None
        if marker in _SOF_BASELINE:
            height, width = struct.unpack(">HH", jpeg[pos + 5 : pos + 9])
            return (width, height) if width and height else None
        if 0xC3 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return None  # lossless or arithmetic: not a preview libjpeg reads
        pos += 2 + length
    return None


def _oriented(jpeg: bytes, orientation: int) -> bytes:
    """The preview without its own APP1 (a preview is stored as the sensor saw it) and with
    one whose only tag is the RAW's orientation."""
    pos, kept = 2, b""
    while pos + 4 <= len(jpeg) and jpeg[pos] == 0xFF and 0xE0 <= jpeg[pos + 1] <= 0xEF:
        length = int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
        if jpeg[pos + 1] != 0xE1:
            kept += jpeg[pos : pos + 2 + length]
        pos += 2 + length
    ifd = struct.pack("<HHHIHH", 1, _ORIENTATION, 3, 1, orientation, 0) + b"\0\0\0\0"
    block = b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd
    app1 = b"\xff\xe1" + struct.pack(">H", len(block) + 2) + block
    return b"\xff\xd8" + kept + app1 + jpeg[pos:]


class _Tiff:
    """A bounded reader of a TIFF structure's IFDs: entries, values and the IFD tree."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.order = "<" if data[:2] == b"II" else ">"

    def first(self) -> int:
        return self._unpack("I", 4)[0]

    def walk(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
        """Every image's declared size, every JPEG span, and IFD0's orientation."""
        images: list[tuple[int, int]] = []
        spans: list[tuple[int, int]] = []
        orientation = 1
        for index, offset in enumerate(self._ifds()):
            tags = self.ifd(offset)
            if index == 0:
                orientation = self.orientation(tags)
            size = self.values(tags.get(_WIDTH))[:1] + self.values(tags.get(_HEIGHT))[:1]
            if len(size) == 2:
                images.append((size[0], size[1]))
            spans += self._spans(tags)
        return images, spans, orientation

    def orientation(self, tags: dict[int, tuple[int, int, bytes]]) -> int:
        """An IFD's Orientation, 1 when absent or out of range."""
        value = (self.values(tags.get(_ORIENTATION)) or [1])[0]
        return value if 1 <= value <= 8 else 1

    def _spans(self, tags: dict[int, tuple[int, int, bytes]]) -> Iterator[tuple[int, int]]:
        for start, size in ((_JPEG_OFFSET, _JPEG_BYTES), (_STRIP_OFFSETS, _STRIP_BYTES)):
            offsets, sizes = self.values(tags.get(start)), self.values(tags.get(size))
            if len(offsets) == 1 and len(sizes) == 1:  # a preview is one strip
                yield offsets[0], sizes[0]
        kind_, count, pointer = tags.get(_RW2_JPEG, (0, 0, b""))
        if kind_ == 7 and count > 4:  # RW2's JpgFromRaw: the JPEG is the tag's value
            yield struct.unpack(self.order + "I", pointer)[0], count

    def _ifds(self) -> Iterator[int]:
        pending, seen = [self.first()], set[int]()
        while pending and len(seen) < MAX_IFDS:
            offset = pending.pop(0)
            if offset in seen or offset == 0:
                continue
            seen.add(offset)
            yield offset
            pending += self.values(self.ifd(offset).get(_SUB_IFDS))[:MAX_IFDS]
            pending.append(self._next(offset))

    def ifd(self, offset: int) -> dict[int, tuple[int, int, bytes]]:
        """Tag → (type, count, the 4 value-or-offset bytes)."""
        (count,) = self._unpack("H", offset)
        if count > MAX_ENTRIES:
            raise CorruptImageError(f"TIFF IFD with {count} entries")
        entries = {}
        for i in range(count):
            tag, kind_, n = self._unpack("HHI", offset + 2 + 12 * i)
            value = self.data[offset + 10 + 12 * i : offset + 14 + 12 * i]
            if len(value) < 4:
                raise CorruptImageError("TIFF IFD cut short by the end of the file")
            entries[tag] = (kind_, n, value)
        return entries

    def _next(self, offset: int) -> int:
        (count,) = self._unpack("H", offset)
        return self._unpack("I", offset + 2 + 12 * count)[0]

    def values(self, entry: tuple[int, int, bytes] | None) -> list[int]:
        """An entry's SHORT/LONG values (at most MAX_IFDS of them); [] for any other type."""
        if entry is None or entry[0] not in (3, 4, 13):
            return []
        code = "H" if entry[0] == 3 else "I"
        count = min(entry[1], MAX_IFDS)
        raw = entry[2] if entry[1] * _TYPE_SIZES[entry[0]] <= 4 else self._at(entry[2])
        return list(self._unpack(code * count, 0, raw[: count * struct.calcsize(code)]))

    def text(self, entry: tuple[int, int, bytes] | None) -> str:
        if entry is None or entry[0] != 2:
            return ""
        raw = entry[2] if entry[1] <= 4 else self._at(entry[2])
        return raw[: min(entry[1], 256)].split(b"\0")[0].decode("latin-1").strip()

    def _at(self, pointer: bytes) -> bytes:
        (offset,) = struct.unpack(self.order + "I", pointer)
        return self.data[offset : offset + 4096]

    def _unpack(self, codes: str, offset: int, data: bytes | None = None) -> tuple[int, ...]:
        source = self.data if data is None else data
        try:
            return struct.unpack_from(self.order + codes, source, offset)
        except struct.error:
            raise CorruptImageError("TIFF structure points past the end of the file") from None
