"""The encoder quality per photo for a perceptual target.

Each trial is one encode of a sample of the rendition's own pixels (tiles across the frame)
scored by a cheap two-scale SSIM of luma, mapped onto SSIMULACRA2's scale by a fit
bench/quality.py measured; then the one full encode at the quality chosen. score=N bisects
to N. q=auto is relative: the photo's own score at the fixed quality says how far above the
floor it sits, and the quality drops by the score difference that allows (a difference
between two encodes of one photo cancels the metric's per-photo offset); the drop chosen on
a photo's first rendition of a format is reused by its others.
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

# q=auto: the score drop allowed is SLOPE x (score at the fixed quality - floor), at most
# MAX_DROP (bench/quality.py --rules calibrated them on half the corpus, checked on the rest).
SLOPE = 0.75
MAX_DROP = 10.0
# The predicted drop per quality step, near the fixed quality, for the first guess of the
# second trial (camera photos at 1024-2048 px: WebP 80 -> 60 loses 7-10 points, JPEG 82 -> 60
# 9-16).
PER_STEP: dict[str, float] = {"webp": 0.45, "jpeg": 0.55, "avif": 0.45}
# A rendition with a long edge under this keeps the fixed quality under q=auto: at thumbnail
# size the luma metric misses what SSIMULACRA2 sees (predicted 75, measured 44 on a wide-gamut
# photo's 320 px thumbnail), and thumbnails are a few percent of the bytes.
MIN_RELATIVE = 512

Encode = Callable[[pyvips.Image, int], bytes]
Save = Callable[[pyvips.Image, RenditionSpec], bytes]


class Choice:
    """The quality chosen and the calibrated score its sample reached."""

    __slots__ = ("quality", "score")

    def __init__(self, quality: int, score: float) -> None:
        self.quality, self.score = quality, score


# A photo's q=auto decisions by format: the quality drop (as `quality`) and the score.
Decided = dict[str, Choice]


def choose(image: pyvips.Image, fmt: str, target: float, encode: Encode) -> Choice:
    """The lowest quality in RANGE whose sample scores at least `target`, else the top."""
    sample = sampled(image)
    reference = Reference(luma(sample))
    low, high = RANGE[fmt]
    scores: dict[int, float] = {}
    for _ in range(STEPS):
        middle = (low + high) // 2
        scores[middle] = similarity(fmt, reference, luma(_decoded(encode(sample, middle))))
        low, high = (low, middle) if scores[middle] >= target else (middle + 1, high)
    if high not in scores:
        scores[high] = similarity(fmt, reference, luma(_decoded(encode(sample, high))))
    return Choice(high, round(scores[high], 2))


def relative(image: pyvips.Image, fmt: str, fixed: int, floor: float, encode: Encode) -> Choice:
    """At most two trials: the score at the fixed quality, then one lower guess; the lowest
    quality whose predicted drop stays within the allowance (interpolated between the two)."""
    sample = sampled(image)
    reference = Reference(luma(sample))
    top = similarity(fmt, reference, luma(_decoded(encode(sample, fixed))))
    allowed = max(0.0, min(MAX_DROP, SLOPE * (top - floor)))
    lowest = RANGE[fmt][0]
    guess = max(lowest, fixed - math.ceil(allowed / PER_STEP[fmt]))
    if guess >= fixed:
        return Choice(fixed, round(top, 2))
    drop = top - similarity(fmt, reference, luma(_decoded(encode(sample, guess))))
    if drop <= allowed:
        return Choice(guess, round(top - drop, 2))
    steps = math.floor((fixed - guess) * allowed / drop)
    return Choice(fixed - steps, round(top - drop * steps / (fixed - guess), 2))


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


class Reference:
    """A sample's luma with its box means and variances at both scales, computed once for
    all of its trials (they are 2 of the 5 box filters a score costs)."""

    __slots__ = ("scales",)

    def __init__(self, pixels: np.ndarray) -> None:
        self.scales = [_stats(pixels), _stats(_half(pixels))]


def _stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mx = _box(x)
    return x, mx, _box(x * x) - mx * mx


def similarity(fmt: str, reference: np.ndarray | Reference, distorted: np.ndarray) -> float:
    """SSIMULACRA2-scaled score of `distorted` against `reference` (equal shapes), at most
    100 as on that scale: the fit's line runs past it for a near-lossless encode (a smooth
    sky), where a drop between two qualities would otherwise be one of extrapolation."""
    a, b = FIT[fmt]
    return min(100.0, a + b * math.log10(max(loss(reference, distorted), 1e-6)))


def loss(reference: np.ndarray | Reference, distorted: np.ndarray) -> float:
    """1 - SSIM pooled as a 4-norm (a few bad boxes weigh more than a mean lets them, as in
    SSIMULACRA2), averaged over full and half scale: what the fit maps onto SSIMULACRA2."""
    if not isinstance(reference, Reference):
        reference = Reference(reference)
    full, half = reference.scales
    return (_ssim_loss(full, distorted) + _ssim_loss(half, _half(distorted))) / 2


def _ssim_loss(stats: tuple[np.ndarray, np.ndarray, np.ndarray], y: np.ndarray) -> float:
    """The 4-norm of 1 - SSIM over WINDOW-wide boxes (box means from summed-area tables)."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    x, mx, vx = stats
    my = _box(y)
    vy, cov = _box(y * y) - my * my, _box(x * y) - mx * my
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
    image: pyvips.Image, spec: RenditionSpec, save: Save, decided: Decided | None = None
) -> tuple[bytes, int, float | None]:
    """The rendition's bytes, the quality they were encoded at and, for a spec with a
    target, the calibrated score its sample reached (None at a fixed quality, and for an
    image too small to score). `decided` holds a photo's q=auto drops by format: the first
    rendition of a format chooses, the others reuse its drop (and report its score)."""
    if spec.target is None or min(image.width, image.height) < MIN_SCORED:
        return save(image, spec), spec.quality, None
    if spec.auto:
        return _relative(image, spec, save, {} if decided is None else decided)
    choice = choose(image, spec.format, spec.target, lambda i, q: save(i, _at(spec, q)))
    return save(image, _at(spec, choice.quality)), choice.quality, choice.score


def _relative(
    image: pyvips.Image, spec: RenditionSpec, save: Save, decided: Decided
) -> tuple[bytes, int, float | None]:
    if max(image.width, image.height) < MIN_RELATIVE:
        return save(image, spec), spec.quality, None
    if spec.format not in decided:
        encode: Encode = lambda i, q: save(i, _at(spec, q))  # noqa: E731
        choice = relative(image, spec.format, spec.quality, spec.target or 0.0, encode)
        decided[spec.format] = Choice(spec.quality - choice.quality, choice.score)
    drop = decided[spec.format]
    chosen = max(RANGE[spec.format][0], min(spec.quality, spec.quality - drop.quality))
    return save(image, _at(spec, chosen)), chosen, drop.score


def _at(spec: RenditionSpec, quality: int) -> RenditionSpec:
    return msgspec.structs.replace(spec, quality=quality)
