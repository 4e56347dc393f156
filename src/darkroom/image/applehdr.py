"""Apple's HDR gain map in a HEIC (an auxiliary image, `urn:com:apple:photo:2020:aux:
hdrgainmap`) as the ISO 21496-1 gain map that uhdrsave writes into JPEG renditions. The
headroom comes from Apple's maker note (tags 33 and 48, Apple's published formula); the map
is re-encoded from Apple's linear boost to ISO's log2 one. Pure: bytes and libvips only.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import pyvips

from darkroom.errors import ImageTooLargeError
from darkroom.image import gainmap, isobmff

MAKER_NOTE_MAGIC = b"Apple iOS\0"
_RATIONAL, _SRATIONAL = 5, 10
AUX_TYPE = "urn:com:apple:photo:2020:aux:hdrgainmap"


def decoded_map(heif: Any, exif_block: bytes | None, max_pixels: int) -> Any:
    """(ISO map at its own size, boost) from a pi-heif file, or None when it has no usable
    Apple map. The pixel budget counts the map (ImageTooLargeError)."""
    ids = heif.info.get("aux", {}).get(AUX_TYPE) or []
    boost = headroom(maker_note(exif_block))
    if not ids or boost is None:
        return None
    aux = heif.get_aux_image(ids[0])
    (map_width, map_height), (width, height) = aux.size, heif.size
    if width * height + map_width * map_height > max_pixels:
        raise ImageTooLargeError(f"{width}x{height} with its gain map is over {max_pixels}")
    if aux.mode != "L" or not gainmap.fits(width, height, map_width, map_height):
        return None
    apple = pyvips.Image.new_from_memory(bytes(aux.data), aux.stride, map_height, 1, "uchar")
    apple = apple.crop(0, 0, map_width, map_height)
    return iso_map(apple, boost).copy_memory(), boost


def scaled_steps(steps: list[isobmff.Step], x_scale: float, y_scale: float) -> list[isobmff.Step]:
    """The base's transformative steps for a map x_scale × y_scale of its size: crops scaled
    (a quarter turn swaps the axes they are measured on), turns and mirrors as they are."""
    scaled = []
    for op, args in steps:
        if op == "crop":
            left, top, width, height = args
            args = (round(left * x_scale), round(top * y_scale),
                    max(1, round(width * x_scale)), max(1, round(height * y_scale)))  # fmt: skip
        elif op == "rotate" and args[0] % 2:
            x_scale, y_scale = y_scale, x_scale
        scaled.append(isobmff.Step(op, args))
    return scaled


def maker_note(exif_block: bytes | None) -> bytes | None:
    """The maker note of a raw EXIF block (any prefix before its TIFF header), or None."""
    start = (exif_block or b"")[:16].find(b"MM\0*")  # Apple writes big-endian EXIF
    if not exif_block or start < 0:
        return None
    from PIL import Image  # imported here, as in exif.py

    exif = Image.Exif()
    try:
        exif.load(exif_block[start:])
        note = exif.get_ifd(0x8769).get(0x927C)
    except Exception:  # a damaged block has no note, never a failure
        return None
    return bytes(note) if isinstance(note, bytes) else None


def headroom(maker_note: bytes | None) -> float | None:
    """The photo's HDR headroom (a linear factor over SDR white), or None when the note
    lacks tags 33 and 48, is damaged, or says the photo has no headroom."""
    if not maker_note or not maker_note.startswith(MAKER_NOTE_MAGIC):
        return None
    try:
        tags = _rationals(maker_note)
    except (struct.error, ZeroDivisionError, IndexError):
        return None
    if 33 not in tags or 48 not in tags:
        return None
    stops = _stops(tags[33], tags[48])
    return 2.0**stops if 0 < stops <= 16 else None


def _stops(maker33: float, maker48: float) -> float:
    if maker33 < 1.0:
        return -20.0 * maker48 + 1.8 if maker48 <= 0.01 else -0.101 * maker48 + 1.601
    return -70.0 * maker48 + 3.0 if maker48 <= 0.01 else -0.303 * maker48 + 2.303


def _rationals(note: bytes) -> dict[int, float]:
    """Tags 33 and 48 of the note's IFD (big-endian, offsets from the note's start)."""
    (count,) = struct.unpack(">H", note[14:16])
    found: dict[int, float] = {}
    for index in range(min(count, 512)):
        tag, kind, _, offset = struct.unpack(">HHII", note[16 + 12 * index : 28 + 12 * index])
        if tag in (33, 48) and kind in (_RATIONAL, _SRATIONAL):
            pattern = ">ii" if kind == _SRATIONAL else ">II"
            numerator, denominator = struct.unpack(pattern, note[offset : offset + 8])
            found[tag] = numerator / denominator
    return found


def iso_map(apple: pyvips.Image, boost: float) -> pyvips.Image:
    """Apple's map (sRGB-encoded g; HDR = SDR · (1 + (boost − 1) · g)) as an ISO 21496-1
    map with min boost 1, max boost `boost`, gamma 1: log2(1 + (boost − 1) · g) / log2(boost)."""
    grey = apple[0].cast("float") / 255.0
    linear = (grey <= 0.04045).ifthenelse(grey / 12.92, ((grey + 0.055) / 1.055) ** 2.4)
    log_boost = ((linear * (boost - 1) + 1).log() / math.log(boost)) * 255.0
    return log_boost.rint().cast("uchar").copy(interpretation="b-w")


def attach(image: pyvips.Image, gain: pyvips.Image, boost: float) -> pyvips.Image:
    """The image with this ISO map (already covering it) and its ISO 21496-1 fields."""
    image = image.copy()
    image.set_type(pyvips.GValue.image_type, "gainmap", gain)
    for name, value in (("max-content-boost", boost), ("min-content-boost", 1.0),
                        ("gamma", 1.0), ("offset-sdr", 0.0), ("offset-hdr", 0.0)):  # fmt: skip
        image.set_type(pyvips.GValue.array_double_type, f"gainmap-{name}", [value] * 3)
    image.set_type(pyvips.GValue.gdouble_type, "gainmap-hdr-capacity-min", 1.0)
    image.set_type(pyvips.GValue.gdouble_type, "gainmap-hdr-capacity-max", boost)
    image.set_type(pyvips.GValue.gint_type, "gainmap-use-base-cg", 1)
    return image
