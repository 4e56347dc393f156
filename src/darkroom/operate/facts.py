"""The photo's facts as an operator reads them: the capture time (local and instant), the
exposure in photographers' words, and the ThumbHash drawn back into the small PNG a
gallery shows before the first rendition (a data: URI, so the page costs no request).
Pure: values in, text out."""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from datetime import datetime
from typing import Any

from darkroom.image import thumbhash


def exposure_text(exposure: dict[str, float] | None) -> str | None:
    """`f/1.8 · 1/120 s · ISO 100 · 4.2 mm (35 mm: 29 mm)` from the stored facts."""
    if not exposure:
        return None
    parts = []
    if (f := exposure.get("f_number")) is not None:
        parts.append(f"f/{f:g}")
    if (t := exposure.get("exposure_time_s")) is not None:
        parts.append(shutter_text(t))
    if (iso := exposure.get("iso")) is not None:
        parts.append(f"ISO {iso:g}")
    if (mm := exposure.get("focal_length_mm")) is not None:
        full_frame = exposure.get("focal_length_35mm")
        parts.append(f"{mm:g} mm" + (f" (35 mm: {full_frame:g} mm)" if full_frame else ""))
    return " · ".join(parts) or None


def shutter_text(seconds: float) -> str:
    """1/120 s below a second (as a camera shows it), else 2.5 s."""
    if 0 < seconds < 1:
        return f"1/{round(1 / seconds)} s"
    return f"{seconds:g} s"


def taken_text(local: datetime | None, instant: datetime | None) -> str | None:
    """The wall-clock time where the photo was taken, and the instant in UTC when known."""
    if local is None and instant is None:
        return None
    shown = local.isoformat(sep=" ", timespec="seconds") if local else "local time unknown"
    if instant is None:
        return f"{shown} (no time zone recorded)"
    return f"{shown} · {instant.isoformat(sep=' ', timespec='seconds')}"


def placeholder_png(thumbhash_b64: str | None) -> bytes | None:
    """The ThumbHash decoded to RGBA (at most 32 px on its long side), as a PNG; None for
    none or one that does not decode."""
    if not thumbhash_b64:
        return None
    try:
        w, h, rgba = thumbhash.decode(base64.b64decode(thumbhash_b64, validate=True))
    except (ValueError, IndexError, binascii.Error):
        return None
    return rgba_png(w, h, rgba)


def rgba_png(w: int, h: int, rgba: bytes) -> bytes:
    """A minimal PNG (8-bit RGBA, no filter) of `w`×`h` pixels."""
    rows = b"".join(b"\0" + rgba[y * w * 4 : (y + 1) * w * 4] for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0)
    chunks = (_chunk(b"IHDR", header), _chunk(b"IDAT", zlib.compress(rows)), _chunk(b"IEND", b""))
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data)
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def swatch_png(color: str | None) -> bytes | None:
    """A 1×1 PNG of `#rrggbb` (the page's CSP allows no inline style, but data: images)."""
    if not color or len(color) != 7 or not color.startswith("#"):
        return None
    try:
        rgb = bytes.fromhex(color[1:])
    except ValueError:
        return None
    return rgba_png(1, 1, rgb + b"\xff")


def data_uri(png: bytes | None) -> str | None:
    return None if png is None else "data:image/png;base64," + base64.b64encode(png).decode()


def readable(facts: dict[str, Any]) -> dict[str, Any]:
    """The stored facts plus what a person reads: `taken`, `exposure_text`, `camera`, and
    the placeholder and the dominant colour's swatch as data: URIs."""
    camera = " ".join(filter(None, (facts.get("camera_make"), facts.get("camera_model"))))
    return {
        **facts,
        "camera": camera or None,
        "taken": taken_text(facts.get("taken_at_local"), facts.get("taken_at")),
        "exposure_text": exposure_text(facts.get("exposure")),
        "placeholder": data_uri(placeholder_png(facts.get("thumbhash"))),
        "swatch": data_uri(swatch_png(facts.get("dominant_color"))),
    }
