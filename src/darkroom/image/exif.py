"""Capture facts from a raw EXIF block: when, with what camera and lens, how exposed, where;
and the name of the embedded ICC profile.

Parsed by Pillow's EXIF reader (a TIFF structure reader, bounded by the block's own size),
never from libvips' display strings. Pure: bytes in, values out. Any damage in the block
(huge counts, loops, offsets past the end, wrong types) gives NULL for what it touches and
never an exception: a photo is never failed for its metadata. It runs inside the isolated
render process, under its time and memory limits.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec

MAX_EXIF_BYTES = 4 * 1024 * 1024  # far above any camera's; larger blocks are not read
EARLIEST = datetime(1826, 1, 1)  # the first photograph
_DATE = re.compile(r"(\d{4}):(\d{2}):(\d{2})[ T](\d{2}):(\d{2}):(\d{2})")
_OFFSET = re.compile(r"([+-])(\d{2}):(\d{2})")
_GPS_DATE = re.compile(r"(\d{4}):(\d{2}):(\d{2})")

# tags (EXIF 2.32)
_EXIF_IFD, _GPS_IFD = 0x8769, 0x8825
_MAKE, _MODEL = 0x010F, 0x0110
_DATETIME_ORIGINAL, _DATETIME_DIGITIZED = 0x9003, 0x9004
_OFFSET_TIME, _OFFSET_ORIGINAL = 0x9010, 0x9011
_SUBSEC_ORIGINAL, _SUBSEC_DIGITIZED = 0x9291, 0x9292
_LENS_MODEL = 0xA434
_EXPOSURE_TAGS = {
    "f_number": 0x829D,
    "exposure_time_s": 0x829A,
    "iso": 0x8827,
    "focal_length_mm": 0x920A,
    "focal_length_35mm": 0xA405,
}
_INTEGER_EXPOSURE = {"iso", "focal_length_35mm"}


class Capture(msgspec.Struct, frozen=True):
    """What the camera recorded; None for whatever is absent, damaged or implausible."""

    taken_at_local: datetime | None = None  # naive: the camera's wall clock
    taken_at: datetime | None = None  # aware: only when the zone or GPS time is recorded
    camera_make: str | None = None
    camera_model: str | None = None
    lens_model: str | None = None
    exposure: dict[str, float] | None = None
    latitude: float | None = None
    longitude: float | None = None


def read(raw: bytes | None, now: datetime | None = None) -> Capture:
    """Capture facts from an EXIF block (with or without its `Exif\\0\\0` prefix)."""
    if not raw or len(raw) > MAX_EXIF_BYTES:
        return Capture()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow warns on damaged blocks; damage is NULL
            return _read(_load(raw), now or datetime.now(UTC))
    except Exception:  # a hostile block may break the reader anywhere: no facts then
        return Capture()


class _Tags:
    """The three IFDs darkroom reads, each tolerant of damage on its own."""

    def __init__(self, exif: Any) -> None:
        self.main = _safe_dict(exif)
        self.exif = _sub_ifd(exif, _EXIF_IFD)
        self.gps = _sub_ifd(exif, _GPS_IFD)


def _load(raw: bytes) -> _Tags:
    # imported here: a render without EXIF does not map Pillow into its address space
    from PIL import Image

    if raw.startswith(b"Exif\x00\x00"):
        raw = raw[6:]
    exif = Image.Exif()
    exif.load(raw)
    return _Tags(exif)


def _safe_dict(exif: Any) -> dict[int, Any]:
    try:
        return dict(exif)
    except Exception:
        return {}


def _sub_ifd(exif: Any, tag: int) -> dict[int, Any]:
    try:
        return dict(exif.get_ifd(tag))
    except Exception:
        return {}


def _read(tags: _Tags, now: datetime) -> Capture:
    local = _local_time(tags.exif, now)
    latitude, longitude = _location(tags.gps)
    return Capture(
        taken_at_local=local,
        taken_at=_instant(local, tags, now),
        camera_make=_text(tags.main.get(_MAKE)),
        camera_model=_text(tags.main.get(_MODEL)),
        lens_model=_text(tags.exif.get(_LENS_MODEL)),
        exposure=_exposure(tags.exif),
        latitude=latitude,
        longitude=longitude,
    )


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return None
    cleaned = "".join(c for c in value if c.isprintable()).strip()
    return cleaned[:200] or None


def _local_time(exif: dict[int, Any], now: datetime) -> datetime | None:
    for tag, subsec in ((_DATETIME_ORIGINAL, _SUBSEC_ORIGINAL),
                        (_DATETIME_DIGITIZED, _SUBSEC_DIGITIZED)):  # fmt: skip
        stamp = _parse_stamp(_text(exif.get(tag)), _text(exif.get(subsec)))
        if stamp is not None and _plausible(stamp, now.replace(tzinfo=None)):
            return stamp
    return None


def _parse_stamp(text: str | None, subsec: str | None) -> datetime | None:
    match = _DATE.match(text or "")
    if match is None:
        return None
    try:
        year, month, day, hour, minute, second = (int(part) for part in match.groups())
        stamp = datetime(year, month, day, hour, minute, second)
    except ValueError:  # 0000:00:00 00:00:00, month 13, and so on
        return None
    digits = "".join(c for c in (subsec or "") if c.isdigit())[:6]
    return stamp.replace(microsecond=int(digits.ljust(6, "0"))) if digits else stamp


def _plausible(stamp: datetime, now: datetime) -> bool:
    """After the first photograph, and no more than a day ahead of now (same kind of clock)."""
    if stamp.tzinfo is not None:
        return EARLIEST.replace(tzinfo=UTC) <= stamp <= now.astimezone(UTC) + timedelta(days=1)
    return EARLIEST <= stamp <= now + timedelta(days=1)


def _instant(local: datetime | None, tags: _Tags, now: datetime) -> datetime | None:
    """The capture instant only when it is recorded: the zone offset, else the GPS clock."""
    offset = _offset(_text(tags.exif.get(_OFFSET_ORIGINAL)) or _text(tags.exif.get(_OFFSET_TIME)))
    if local is not None and offset is not None:
        return local.replace(tzinfo=offset)
    gps = _gps_time(tags.gps)
    return gps if gps is not None and _plausible(gps, now) else None


def _offset(text: str | None) -> timezone | None:
    match = _OFFSET.fullmatch(text or "")
    if match is None:
        return None
    sign, hours, minutes = match.groups()
    delta = timedelta(hours=int(hours), minutes=int(minutes))
    if delta > timedelta(hours=14) or int(minutes) >= 60:
        return None
    return timezone(-delta if sign == "-" else delta)


def _gps_time(gps: dict[int, Any]) -> datetime | None:
    match = _GPS_DATE.fullmatch(_text(gps.get(29)) or "")
    hms = gps.get(7)
    if match is None or not isinstance(hms, tuple) or len(hms) != 3:
        return None
    try:
        hours, minutes, seconds = (float(v) for v in hms)
        year, month, day_of_month = (int(p) for p in match.groups())
        day = datetime(year, month, day_of_month, tzinfo=UTC)
        if not (0 <= hours < 24 and 0 <= minutes < 60 and 0 <= seconds < 61):
            return None
        return day + timedelta(hours=int(hours), minutes=int(minutes), seconds=seconds)
    except (ValueError, ZeroDivisionError, TypeError, OverflowError):
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, tuple) and value:
        value = value[0]  # ISO is a list of values; the first is the speed
    try:
        number = float(value)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    return number if math.isfinite(number) and 0 < number < 1e7 else None


def _exposure(exif: dict[int, Any]) -> dict[str, float] | None:
    found: dict[str, float] = {}
    for name, tag in _EXPOSURE_TAGS.items():
        number = _number(exif.get(tag))
        if number is not None:
            found[name] = round(number) if name in _INTEGER_EXPOSURE else round(number, 6)
    return found or None


def _location(gps: dict[int, Any]) -> tuple[float | None, float | None]:
    latitude = _coordinate(gps.get(2), _text(gps.get(1)), "N", "S", 90)
    longitude = _coordinate(gps.get(4), _text(gps.get(3)), "E", "W", 180)
    if latitude is None or longitude is None:
        return None, None
    return latitude, longitude


def _coordinate(dms: Any, ref: str | None, plus: str, minus: str, limit: float) -> float | None:
    if not isinstance(dms, tuple) or len(dms) != 3 or ref not in (plus, minus):
        return None
    try:
        degrees, minutes, seconds = (float(v) for v in dms)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    value = degrees + minutes / 60 + seconds / 3600
    if not math.isfinite(value) or not 0 <= value <= limit:
        return None
    return round(-value if ref == minus else value, 7)


def profile_name(icc: bytes | None) -> str | None:
    """The ICC profile's description ("Display P3"), or None if absent or unreadable."""
    if not icc:
        return None
    from PIL import ImageCms

    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        name = str(profile.profile.profile_description or "").strip()
    except Exception:  # a damaged profile names nothing
        return None
    return "".join(c for c in name if c.isprintable())[:200] or None
