"""A sensor decode given the camera's tones (image/tones.py): the preview's percentiles per
channel, black kept, no curve steeper than MAX_SLOPE, a letterboxed preview's bars ignored."""

from __future__ import annotations

import numpy as np
import pytest
import pyvips

from darkroom.image import tones


def _scene(width: int = 600, height: int = 400) -> pyvips.Image:
    """A photo-like frame: gradients in each channel and a bright square off-centre."""
    x = pyvips.Image.xyz(width, height)
    r = (x[0] * 255 / width).cast("uchar")
    g = (x[1] * 255 / height).cast("uchar")
    b = ((x[0] + x[1]) * 255 / (width + height)).cast("uchar")
    frame = r.bandjoin([g, b]).copy(interpretation="srgb")
    return frame.insert(pyvips.Image.black(80, 80, bands=3) + 230, 400, 60).cast("uchar")


def _darker(image: pyvips.Image, gamma: float = 1.8) -> pyvips.Image:
    """The same frame as a flat rendering would give it: darker mid-tones, black and white kept."""
    return ((image / 255) ** gamma * 255).cast("uchar").copy(interpretation="srgb")


def _levels(image: pyvips.Image) -> np.ndarray:
    return np.asarray(image.numpy(), dtype=np.float64)


def test_a_darker_decode_takes_the_previews_tones() -> None:
    """A preview at a quarter of the size: the matched decode's levels are within a few of the
    preview's everywhere, where the flat decode's were tens lower."""
    preview = _scene()
    flat = _darker(preview)
    matched = tones.matched(flat, preview.resize(0.25))
    assert matched.interpretation == "srgb"
    before = np.abs(_levels(flat) - _levels(preview)).mean()
    after = np.abs(_levels(matched) - _levels(preview)).mean()
    assert before > 25
    assert after < 4


def test_a_letterboxed_preview_gives_the_same_tones() -> None:
    """A preview padded to 16:9 with black bars: only its middle is compared."""
    preview = _scene()
    wide = pyvips.Image.black(712, 400, bands=3).insert(preview, 56, 0).copy(interpretation="srgb")
    flat = _darker(preview)
    plain, padded = tones.matched(flat, preview), tones.matched(flat, wide)
    assert np.abs(_levels(plain) - _levels(padded)).max() <= 2


def test_without_a_preview_the_decode_is_unchanged() -> None:
    flat = _darker(_scene())
    assert tones.matched(flat, None) is flat
    grey = _scene().colourspace("b-w")
    assert tones.matched(flat, grey) is flat  # no colour reference: LibRaw's tones stay


def test_curves_are_monotone_keep_black_and_reach_white_without_steep_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A channel the decode barely has (a stage lit blue has red only in its noise) would be
    stretched over a hundred levels; the curve climbs at most MAX_SLOPE a level and meets the
    target where it climbs more slowly."""
    rng = np.random.default_rng(7)
    source = np.clip(rng.normal(3, 1.5, 50_000), 0, 255)
    target = np.clip(rng.normal(90, 40, 50_000), 0, 255)
    curve = tones._curve(source, target).astype(int)
    steps = np.diff(curve)
    assert curve[0] == 0 and curve[255] == 255
    assert steps.min() >= 0
    assert steps.max() <= tones.MAX_SLOPE
    monkeypatch.setattr(tones, "MAX_SLOPE", 10_000)
    steep = tones._curve(source, target).astype(int)
    assert steps.max() < np.diff(steep).max()  # the cap did bind
    rejoined = 1 + int(np.argmax(curve[1:] == steep[1:]))
    assert 0 < rejoined < 64
    assert (curve[rejoined:] == steep[rejoined:]).all()


def test_white_stays_white_when_the_decode_clips_its_lights() -> None:
    """LibRaw clips about 1 % of a photo's pixels at 255: its top percentile then sits at white,
    and the curve must still take white to white (clipped lamps stay white, not grey)."""
    rng = np.random.default_rng(11)
    target = np.concatenate((np.clip(rng.normal(100, 40, 99_400), 0, 250), np.full(600, 255.0)))
    for clipped in (0.009, 0.011, 0.05):
        count = int(100_000 * clipped)
        body = np.clip(rng.normal(80, 35, 100_000 - count), 0, 254)
        curve = tones._curve(np.concatenate((body, np.full(count, 255.0))), target)
        assert curve[255] == 255, clipped
        if clipped < 0.02:  # a hair of clipping leaves the lights where the preview has them
            assert curve[250] >= 240, clipped
