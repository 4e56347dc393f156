"""A sensor decode given the camera's tones: LibRaw renders a RAW colorimetrically, with none of
the tone curve (and shadow lifting) the camera applied to the JPEG it embedded, so its renditions
come out darker and flatter than the picture the photographer saw on the camera (a Sony
ILCE-7RM3's stage photo: mean luma 25 against its preview's 38). The embedded preview is the
camera's own rendering of the same frame, so its tones are the reference: for each channel, a
curve from the decode's percentiles to the preview's, applied in one lookup
(docs/photos.md#camera-raw).
"""

from __future__ import annotations

import numpy as np
import pyvips

# The percentiles each curve passes through: dense where photos put most of their tones,
# and none at the extremes, where a few clipped or noisy pixels would bend it.
PERCENTILES = (1, 3, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 85, 90, 95, 97, 99)
# Sizes whose percentiles are compared: enough pixels for stable statistics, cheap to read.
SAMPLE_EDGE = 256
# The steepest a curve may climb, in output levels per input level: where the decode has
# almost none of a channel (a stage lit blue has red only in its noise), the preview's
# percentiles would stretch it tenfold (that ARW's red: median 2 to 25, 99th 12 to 104), and
# the noise with it.
MAX_SLOPE = 4
# Aspect ratios further apart than this: the preview is letterboxed (or another crop), and
# only its middle, at the decode's aspect, is compared.
ASPECT_SLACK = 0.03


def matched(decoded: pyvips.Image, preview: pyvips.Image | None) -> pyvips.Image:
    """`decoded` (8-bit sRGB) with the tones of `preview` (the camera's rendering of the same
    frame, any size and orientation); unchanged without one."""
    if preview is None:
        return decoded
    reference = _same_frame(preview.autorot(), decoded.width / decoded.height)
    ours, theirs = _channels(decoded), _channels(reference)
    if ours.shape[1] != 3 or theirs.shape[1] != 3:
        return decoded
    curves = np.stack([_curve(ours[:, c], theirs[:, c]) for c in range(3)], axis=-1)
    lut = pyvips.Image.new_from_array(curves.reshape(1, 256, 3)).cast("uchar")
    return decoded.maplut(lut).copy(interpretation="srgb")


def _same_frame(preview: pyvips.Image, aspect: float) -> pyvips.Image:
    """The part of the preview at the decode's aspect ratio (a letterboxed preview's black
    bars would pull the curve down)."""
    own = preview.width / preview.height
    if abs(own - aspect) <= ASPECT_SLACK * aspect:
        return preview
    if own > aspect:  # wider: keep the middle columns
        width = max(1, round(preview.height * aspect))
        return preview.crop((preview.width - width) // 2, 0, width, preview.height)
    height = max(1, round(preview.width / aspect))
    return preview.crop(0, (preview.height - height) // 2, preview.width, height)


def _channels(image: pyvips.Image) -> np.ndarray:
    """The image's pixels at SAMPLE_EDGE px, one row each, its colour bands as columns."""
    small = image.thumbnail_image(SAMPLE_EDGE, height=SAMPLE_EDGE)
    pixels: np.ndarray = np.asarray(small.numpy(), dtype=np.float64)
    return pixels.reshape(-1, 1) if pixels.ndim == 2 else pixels.reshape(-1, pixels.shape[2])[:, :3]


def _curve(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """A monotone 256-entry curve taking `source`'s percentiles to `target`'s, black kept
    black and white white (a percentile already at either end, as LibRaw's clipped lights
    put its 99th at 255, says nothing of the curve between), no steeper than MAX_SLOPE (where
    it would be, it falls short of the target and meets it again where the target climbs
    more slowly)."""
    points = [(0.0, 0.0)]
    quantiles = np.percentile(source, PERCENTILES), np.percentile(target, PERCENTILES)
    for x, y in zip(*quantiles, strict=True):
        if points[-1][0] + 0.5 < x < 254.5:  # a flat stretch of the source gives one point
            points.append((float(x), max(float(y), points[-1][1])))
    points.append((255.0, 255.0))
    xs, ys = zip(*points, strict=True)
    wanted = np.interp(np.arange(256), xs, ys)
    curve = np.empty(256)
    curve[0] = wanted[0]
    for level in range(1, 256):
        curve[level] = min(wanted[level], curve[level - 1] + MAX_SLOPE)
    curve[255] = 255.0  # the cap may fall short of it: clipped pixels stay white all the same
    return np.clip(np.rint(curve), 0, 255).astype(np.uint8)
