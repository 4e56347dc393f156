"""The facts as an operator reads them (operate/facts.py): pure, no server."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pyvips

from darkroom.image import thumbhash
from darkroom.operate import facts


def test_exposure_reads_as_a_camera_shows_it() -> None:
    """Aperture, shutter as a fraction, ISO and focal length with its 35 mm equivalent."""
    shown = facts.exposure_text({"f_number": 2.2, "exposure_time_s": 0.025, "iso": 32,
                                 "focal_length_mm": 4.15, "focal_length_35mm": 29})  # fmt: skip
    assert shown == "f/2.2 · 1/40 s · ISO 32 · 4.15 mm (35 mm: 29 mm)"
    assert facts.exposure_text({"exposure_time_s": 2.5}) == "2.5 s"
    assert facts.exposure_text(None) is None


def test_capture_time_shows_local_and_instant_or_says_what_is_missing() -> None:
    """Local wall clock, then the UTC instant; no zone recorded is said, not guessed."""
    local = datetime(2015, 4, 10, 20, 12, 23)
    instant = datetime(2015, 4, 10, 18, 12, 22, tzinfo=UTC)
    assert facts.taken_text(local, instant) == "2015-04-10 20:12:23 · 2015-04-10 18:12:22+00:00"
    assert facts.taken_text(local, None) == "2015-04-10 20:12:23 (no time zone recorded)"
    assert facts.taken_text(None, None) is None


def test_the_placeholder_is_a_png_of_the_hash_at_its_aspect_ratio() -> None:
    """A 4:3 red image's hash draws a PNG 32 px wide and about 24 high (the hash keeps the
    ratio approximately), reddish; a bad hash draws nothing."""
    rgba = bytes([200, 30, 30, 255]) * (40 * 30)
    text = base64.b64encode(thumbhash.encode(40, 30, rgba)).decode()
    png = facts.placeholder_png(text)
    assert png is not None
    image = pyvips.Image.new_from_buffer(png, "")
    assert (image.width, image.bands) == (32, 4) and 22 <= image.height <= 24
    r, g, b, _ = image.getpoint(16, 11)
    assert r > 150 and g < 80 and b < 80
    assert facts.placeholder_png("not base64!") is None and facts.placeholder_png(None) is None


def test_the_swatch_is_one_pixel_of_the_dominant_colour() -> None:
    """`#556a4b` becomes a 1×1 PNG of exactly that colour; anything else, none."""
    png = facts.swatch_png("#556a4b")
    assert png is not None
    assert pyvips.Image.new_from_buffer(png, "").getpoint(0, 0) == [0x55, 0x6A, 0x4B, 255]
    assert facts.swatch_png("green") is None and facts.swatch_png("#zzzzzz") is None
