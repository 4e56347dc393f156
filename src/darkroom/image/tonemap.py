"""PQ and HLG originals without a gain map, tone-mapped to the SDR renditions every format
gets: the signal to display light (SMPTE ST 2084 / ARIB STD-B67), BT.2100 reference white
(203 cd/m²) to SDR white, highlights above a knee rolled off by an extended Reinhard shoulder
on the largest channel (hue kept, nothing clipped), BT.2020 primaries to sRGB. Pure libvips.
"""

from __future__ import annotations

import pyvips

REFERENCE_WHITE_NITS = 203.0  # ITU-R BT.2408: the HDR level an SDR display shows as white
KNEE = 0.75  # linear SDR level below which the picture is left as the grade made it
PEAK_NITS = {"pq": 4000.0, "hlg": 1000.0}  # the curve reaches 1 there (PQ: a usual mastering peak)
BT2020_PRIMARIES = 9  # ITU-T H.273 colour primaries
_BT2020_TO_BT709 = [
    [1.6605, -0.5876, -0.0728],
    [-0.1246, 1.1329, -0.0083],
    [-0.0182, -0.1006, 1.1187],
]
_PQ = {"m1": 2610 / 16384, "m2": 2523 / 4096 * 128, "c1": 3424 / 4096,
       "c2": 2413 / 4096 * 32, "c3": 2392 / 4096 * 32}  # fmt: skip
_HLG = {"a": 0.17883277, "b": 0.28466892, "c": 0.55991073}


def to_sdr(image: pyvips.Image, transfer: str, primaries: int) -> pyvips.Image:
    """The decoded PQ/HLG signal (RGB, any depth, alpha kept) as 8-bit sRGB."""
    colour, alpha = _split(image)
    signal = colour.cast("float") / (65535.0 if colour.format == "ushort" else 255.0)
    nits = pq_nits(signal) if transfer == "pq" else hlg_nits(signal)
    if primaries == BT2020_PRIMARIES:
        nits = nits.recomb(_BT2020_TO_BT709)
    linear = rolled_off(_positive(nits) / REFERENCE_WHITE_NITS, PEAK_NITS[transfer])
    sdr = linear.copy(interpretation="scrgb").colourspace("srgb").cast("uchar")
    return sdr.bandjoin(alpha) if alpha is not None else sdr


def _split(image: pyvips.Image) -> tuple[pyvips.Image, pyvips.Image | None]:
    if image.bands == 4:
        scale = 1 / 257.0 if image.format == "ushort" else 1.0
        return image.extract_band(0, n=3), (image[3] * scale).cast("uchar")
    return (image.bandjoin([image, image]) if image.bands == 1 else image), None


def pq_nits(signal: pyvips.Image) -> pyvips.Image:
    """SMPTE ST 2084 EOTF: signal 0-1 to display light in cd/m² (0-10000)."""
    power = signal ** (1 / _PQ["m2"])
    numerator = _positive(power - _PQ["c1"])
    return (numerator / (_PQ["c2"] - power * _PQ["c3"])) ** (1 / _PQ["m1"]) * 10000.0


def hlg_nits(signal: pyvips.Image) -> pyvips.Image:
    """ARIB STD-B67 inverse OETF and the BT.2100 OOTF of a 1000 cd/m² display (γ 1.2)."""
    a, b, c = _HLG["a"], _HLG["b"], _HLG["c"]
    scene = (signal <= 0.5).ifthenelse(signal * signal / 3, (((signal - c) / a).exp() + b) / 12)
    luma = scene.recomb([[0.2627, 0.6780, 0.0593]])
    return scene * (luma + 1e-9) ** 0.2 * 1000.0


def rolled_off(linear: pyvips.Image, peak_nits: float) -> pyvips.Image:
    """Identity up to KNEE of SDR white, then an extended Reinhard shoulder on max(R, G, B)
    that reaches 1 at the signal's peak (slope 1 at the knee); every channel is scaled alike,
    so hue is kept and no channel clips."""
    largest = linear[0].maxpair(linear[1]).maxpair(linear[2]) + 1e-9
    room = 1 - KNEE
    white = (peak_nits / REFERENCE_WHITE_NITS - KNEE) / room
    excess = _positive(largest - KNEE) / room
    shoulder = KNEE + room * excess * (1 + excess / (white * white)) / (1 + excess)
    return linear * ((largest > KNEE).ifthenelse(shoulder, largest) / largest)


def _positive(image: pyvips.Image) -> pyvips.Image:
    return (image > 0).ifthenelse(image, 0.0)
