"""The lowest encoder quality that meets a perceptual target, per photo and rendition.

A bisection over quality, each step one encode of a sample of the rendition's own pixels
(tiles across the frame) scored by a cheap two-scale SSIM of luma, mapped onto SSIMULACRA2's
scale by a fit bench/quality.py measured; then the one full encode at the quality chosen.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
import numpy as np
import pyvips

from darkroom.settings import RenditionSpec

# The quality each format's bisection may choose from: below it blocking shows whatever a
# score says, above it bytes grow with nothing left to see.
RANGE: dict[str, tuple[int, int]] = {"webp": (50, 90), "jpeg": (50, 92), "avif": (30, 80)}
STEPS = 3  # encodes of the sample: a 40-wide range to within 5 quality steps
TILE = 128  # the sample: a 3x3 grid of tiles this wide (384 px: 7 % of a 2048 px rendition)
GRID = 3
WINDOW = 8  # SSIM's box window, pixels
# A side shorter than this has no window at half scale to score: such a rendition (an icon,
# never enlarged) is encoded at the format's fixed quality, with no score.
MIN_SCORED = 4 * WINDOW
# score ≈ A + B * log10(loss), least squares against SSIMULACRA2 over the team's camera
# photos at 1024 px, q 40..90 (bench/quality.py --calibrate; rms error 3.0 webp, 3.9 jpeg).
# AVIF was not measured: it borrows the fit of both formats together.
FIT: dict[str, tuple[float, float]] = {
    "webp": (14.79, -38.25),
    "jpeg": (13.64, -40.78),
    "avif": (13.73, -39.88),
}

Encode = Callable[[pyvips.Image, int], bytes]
Save = Callable[[pyvips.Image, RenditionSpec], bytes]


class Choice:
    """The quality chosen and the calibrated score its sample reached."""

    __slots__ = ("quality", "score")

    def __init__(self, quality: int, score: float) -> None:
        self.quality, self.score = quality, score


def choose(image: pyvips.Image, fmt: str, target: float, encode: Encode) -> Choice:
    """The lowest quality in RANGE whose sample scores at least `target`, else the top."""
    sample = sampled(image)
    reference = luma(sample)
    low, high = RANGE[fmt]
    scores: dict[int, float] = {}
    for _ in range(STEPS):
        middle = (low + high) // 2
        scores[middle] = similarity(fmt, reference, luma(_decoded(encode(sample, middle))))
        low, high = (low, middle) if scores[middle] >= target else (middle + 1, high)
    if high not in scores:
        scores[high] = similarity(fmt, reference, luma(_decoded(encode(sample, high))))
    return Choice(high, round(scores[high], 2))


def sampled(image: pyvips.Image) -> pyvips.Image:
    """The image itself when a side is short (a tile of a 2×1000 strip would be empty),
    else GRIDxGRID tiles spread evenly across it, joined."""
    if image.width <= TILE * GRID or image.height <= TILE * GRID:
        return image
    tile_w, tile_h = min(TILE, image.width // GRID), min(TILE, image.height // GRID)
    xs = [round(i * (image.width - tile_w) / (GRID - 1)) for i in range(GRID)]
    ys = [round(j * (image.height - tile_h) / (GRID - 1)) for j in range(GRID)]
    tiles = [image.crop(x, y, tile_w, tile_h) for y in ys for x in xs]
    return pyvips.Image.arrayjoin(tiles, across=GRID).copy_memory()


def luma(image: pyvips.Image) -> np.ndarray:
    """Rec. 601 luma of the RGB (or grey) bands as float32, alpha ignored."""
    if image.hasalpha():
        image = image.extract_band(0, n=image.bands - 1)
    pixels = np.ndarray(
        buffer=image.cast("uchar").write_to_memory(),
        dtype=np.uint8,
        shape=(image.height, image.width, image.bands),
    ).astype(np.float32)
    if image.bands < 3:
        return pixels[:, :, 0]
    return np.asarray(0.299 * pixels[:, :, 0] + 0.587 * pixels[:, :, 1] + 0.114 * pixels[:, :, 2])


def similarity(fmt: str, reference: np.ndarray, distorted: np.ndarray) -> float:
    """SSIMULACRA2-scaled score of `distorted` against `reference` (equal shapes)."""
    a, b = FIT[fmt]
    return a + b * math.log10(max(loss(reference, distorted), 1e-6))


def loss(reference: np.ndarray, distorted: np.ndarray) -> float:
    """1 - SSIM pooled as a 4-norm (a few bad boxes weigh more than a mean lets them, as in
    SSIMULACRA2), averaged over full and half scale: what the fit maps onto SSIMULACRA2."""
    half = _ssim_loss(_half(reference), _half(distorted))
    return (_ssim_loss(reference, distorted) + half) / 2


def _ssim_loss(x: np.ndarray, y: np.ndarray) -> float:
    """The 4-norm of 1 - SSIM over WINDOW-wide boxes (box means from summed-area tables)."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = _box(x), _box(y)
    vx, vy, cov = _box(x * x) - mx * mx, _box(y * y) - my * my, _box(x * y) - mx * my
    ssim = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(((1.0 - ssim) ** 4).mean() ** 0.25)


def _box(a: np.ndarray) -> np.ndarray:
    """The mean of every WINDOW x WINDOW box fully inside `a`."""
    s = np.pad(a.astype(np.float64), ((1, 0), (1, 0))).cumsum(0).cumsum(1)
    w = WINDOW
    return np.asarray((s[w:, w:] - s[:-w, w:] - s[w:, :-w] + s[:-w, :-w]) / (w * w))


def _half(a: np.ndarray) -> np.ndarray:
    h, w = a.shape[0] // 2 * 2, a.shape[1] // 2 * 2
    return np.asarray((a[:h:2, :w:2] + a[1:h:2, :w:2] + a[:h:2, 1:w:2] + a[1:h:2, 1:w:2]) / 4)


def _decoded(data: bytes) -> pyvips.Image:
    return pyvips.Image.new_from_buffer(data, "")


def encoded(
    image: pyvips.Image, spec: RenditionSpec, save: Save
) -> tuple[bytes, int, float | None]:
    """The rendition's bytes, the quality they were encoded at and, for a spec with a
    target, the calibrated score its sample reached (None at a fixed quality, and for an
    image too small to score)."""
    if spec.target is None or min(image.width, image.height) < MIN_SCORED:
        return save(image, spec), spec.quality, None
    choice = choose(image, spec.format, spec.target, lambda i, q: save(i, _at(spec, q)))
    return save(image, _at(spec, choice.quality)), choice.quality, choice.score


def _at(spec: RenditionSpec, quality: int) -> RenditionSpec:
    return msgspec.structs.replace(spec, quality=quality)
