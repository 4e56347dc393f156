"""Checks on rendition FILES (bytes), shared by the tests: format, size, metadata leaks."""

from __future__ import annotations

import pyvips

from darkroom.image import exif

METADATA_FIELDS = ("exif-data", "xmp-data", "iptc-data", "icc-profile-data")
METADATA_BYTES = (
    b"Exif\x00\x00",
    b"GPS",
    b"<x:xmpmeta",
    b"http://ns.adobe.com/xap",
    b"Photoshop 3.0",
)


def sniff(data: bytes) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[4:12] in (b"ftypavif", b"ftypavis"):
        return "avif"
    return "unknown"


def webp_chunks(data: bytes) -> list[bytes]:
    chunks, pos = [], 12
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        chunks.append(tag)
        pos += 8 + size + (size & 1)
    return chunks


def jpeg_markers(data: bytes) -> list[int]:
    """Marker bytes up to the start of scan (APPn = 0xE0..0xEF)."""
    markers, pos = [], 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        markers.append(marker)
        if marker == 0xDA:
            break
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return markers


def metadata_leaks(data: bytes) -> list[str]:
    """Every sign of EXIF/XMP/IPTC/GPS/ICC left in an output file; empty when clean. A JPEG
    that carries a gain map is judged by `gain_map_leaks` (docs/hdr.md)."""
    image = pyvips.Image.new_from_buffer(data, "")
    if image.get("vips-loader").startswith("uhdrload"):
        return gain_map_leaks(data)
    found = [name for name in METADATA_FIELDS if image.get_typeof(name)]
    found += [repr(pattern) for pattern in METADATA_BYTES if pattern in data]
    if sniff(data) == "webp":
        found += [c.decode() for c in webp_chunks(data) if c in (b"EXIF", b"XMP ", b"ICCP")]
    if sniff(data) == "jpeg":
        found += [f"APP{m - 0xE0}" for m in jpeg_markers(data) if m in (0xE1, 0xE2, 0xED)]
    return found


def mean_abs_diff(a: bytes, b: bytes) -> float:
    """Mean absolute difference of two decoded images of the same size."""
    first, second = pyvips.Image.new_from_buffer(a, ""), pyvips.Image.new_from_buffer(b, "")
    return float((first - second).abs().avg())


def gain_map_leaks(data: bytes) -> list[str]:
    """Every sign of a capture fact, XMP or IPTC in an Ultra HDR JPEG, base and map: its
    container's own EXIF (dimensions, resolution), ICC, ISO 21496-1 and MPF blocks are allowed."""
    found = [repr(p) for p in METADATA_BYTES if p in data and p != b"Exif\x00\x00"]
    secondary = data.index(b"\xff\xd9\xff\xd8\xff") + 2
    for part in (data[:secondary], data[secondary:]):
        image = pyvips.Image.new_from_buffer(part, "")
        found += [name for name in ("xmp-data", "iptc-data") if image.get_typeof(name)]
        found += ["APP13"] if 0xED in jpeg_markers(part) else []
        if image.get_typeof("exif-data"):
            capture = exif.read(bytes(image.get("exif-data")))
            found += [] if capture == exif.Capture() else [f"EXIF capture facts: {capture}"]
    return found
