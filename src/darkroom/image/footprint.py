"""What decoding a photo will hold in a render process, estimated from its header before the
render (the pool's memory budget admits renders by it, image/budget.py).

The header is read here in pure Python, in the worker's process, from the original's bytes
already downloaded: JPEG's frame header, PNG's IHDR, WebP's and GIF's canvas, HEIF/AVIF's
`ispe`. No libvips and no decoder: the worker keeps none of their memory, and a tiny photo
pays a few microseconds. A header that does not read is estimated at the floor: such a photo
fails early in its render (and its process has its own address-space limit).

The factors are measured, not derived (docs/performance.md, "A memory budget across render
slots"): peak resident memory a warm render process gained rendering the default renditions,
per megapixel of the original, one libvips thread. libheif decodes the whole image (no
shrink-on-load) and holds its own planes beside the RGB copy, so HEIF/AVIF cost several
times what JPEG costs, whose decoder shrinks while it reads.
"""

from __future__ import annotations

import struct

from darkroom.errors import DarkroomError, UnsupportedFormatError
from darkroom.image import isobmff, raw
from darkroom.image.pipeline import sniff

# MB of peak resident memory per megapixel, above a warm render process's idle size
MB_PER_MEGAPIXEL = {
    "jpeg": 1.5,  # shrink-on-load: 27–63 MB from 3 to 48 MP
    "webp": 1.0,  # shrink-on-load too: 23–55 MB from 3 to 48 MP, not growing with size
    "png": 4.3,  # decoded whole: 28–213 MB from 3 to 48 MP
    "gif": 4.3,  # not measured apart: taken as PNG's
    "heic": 5.0,  # libheif/libde265, the RGB kept in libheif's buffer: 75–76 MB at 12 MP
    "avif": 15.5,  # libheif/dav1d, no shrink-on-load: 48–715 MB from 3 to 48 MP
    # LibRaw (image/rawdecode.py), per megapixel of the sensor: its raw frame, its 4-channel
    # 16-bit image and the 8-bit output; 87 MB at 6 MP and 298 MB at 24 MP decoded whole,
    # 109 MB at 24 MP at half size
    "raw_full": 14.5,
    "raw_half": 4.5,
}
# The default list's largest rendition: whether a RAW's preview covers it, or how LibRaw
# decodes it, is judged against this (a list with a larger one is rarer, and still bounded
# by the render process's own address-space limit).
RAW_EDGE = 2048
# A RAW whose sensor size is not read here (RAF, CR3, an RW2's): taken as an APS-C
# camera's 26 MP at half size, not the floor, since LibRaw decodes most of them (their
# previews are shorter than RAW_EDGE)
ASSUMED_RAW_MP = 26.0
# What a render of 1 MP or more holds whatever its size: the decode's first tiles, the
# renditions' buffers, the encoders (a 2 MP JPEG: 21–28 MB). Smaller photos make smaller
# renditions (never enlarged): from TINY_MB (a 64×48 PNG: 4 MB; 0.2 MP: 4–6 MB) up to it.
FLOOR_MB = 20
TINY_MB = 4
# 16-bit samples: a 16-bit PNG measured 1.2–1.3× its 8-bit copy, up to 1.4× in other runs
DEEP = 1.4


def estimate_mb(data: bytes) -> int:
    """Peak resident memory the render of `data` is expected to add to its process, in MB."""
    try:
        fmt = sniff(data)
        if fmt in raw.KINDS:
            return _raw_mb(data, fmt)
        size = _size(data, fmt)
    except (DarkroomError, struct.error, IndexError, ValueError):
        return FLOOR_MB
    if size is None:
        return FLOOR_MB
    width, height, deep = size
    return _mb(width * height / 1e6 * (DEEP if deep else 1.0), fmt)


def _mb(megapixels: float, kind: str) -> int:
    fixed = TINY_MB + (FLOOR_MB - TINY_MB) * min(megapixels, 1.0)
    return round(fixed + MB_PER_MEGAPIXEL[kind] * megapixels)


def _raw_mb(data: bytes, fmt: str) -> int:
    """A RAW renders from its preview (a JPEG of the preview's size) when that covers
    RAW_EDGE, else from its sensor data through LibRaw, at half size when that covers it."""
    try:
        width, height = raw.preview_size(data, fmt, RAW_EDGE, 2**62, decoder=True)
        return _mb(width * height / 1e6, "jpeg")
    except UnsupportedFormatError:
        sensor = raw.sensor_size(data)
    if sensor is None:
        return _mb(ASSUMED_RAW_MP, "raw_half")
    kind = "raw_half" if raw.half_size(*sensor, RAW_EDGE) else "raw_full"
    return _mb(sensor[0] * sensor[1] / 1e6, kind)


def _size(data: bytes, fmt: str) -> tuple[int, int, bool] | None:
    """(width, height, more than 8 bits a sample) from the header; None if it does not say."""
    if fmt == "jpeg":
        return _jpeg(data)
    if fmt == "png":  # IHDR comes first: width, height, bit depth
        width, height, bits = struct.unpack(">IIB", data[16:25])
        return width, height, bits == 16
    if fmt == "gif":
        width, height = struct.unpack("<HH", data[6:10])
        return width, height, False
    if fmt == "webp":
        return _webp(data)
    width, height = isobmff.largest_image(isobmff.parse(data))
    return (width, height, False) if width and height else None


# JPEG markers that start a frame (SOF0–SOF15 but DHT, JPG and DAC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(data: bytes) -> tuple[int, int, bool] | None:
    """The frame header's size: walk the marker segments up to the first SOF."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if marker in _SOF:
            bits, height, width = struct.unpack(">BHH", data[at + 4 : at + 9])
            return width, height, bits > 8
        at += 2 + length
    return None


def _webp(data: bytes) -> tuple[int, int, bool] | None:
    """The canvas of VP8X, else the lossy (VP8) or lossless (VP8L) frame's size."""
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        return width, int.from_bytes(data[27:30], "little") + 1, False
    if chunk == b"VP8 ":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF, False
    if chunk == b"VP8L":
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, False
    return None
