"""ThumbHash (Evan Wallace's placeholder format): encode an RGBA image of at most 100×100 px
into ~25 bytes, and decode those bytes back (the tests use the decoder to check the hash).

A port of the reference algorithm, written for darkroom (the PyPI packages are single,
unmaintained releases). The encoder runs in numpy: the DCT is two matrix products (rows,
then columns), which gives the reference's coefficients; the decoder stays plain Python.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

MAX_SIDE = 100
# A term this close to zero is zero in exact arithmetic (a flat or symmetric image): left as
# summation noise, its sign would pick a nibble (7 or 8) by the BLAS's order of additions.
_NOISE = 1e-12
_Floats = npt.NDArray[np.float64]


def encode(w: int, h: int, rgba: bytes) -> bytes:
    """ThumbHash bytes of `w`×`h` RGBA pixels (not premultiplied), row by row."""
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE) or len(rgba) != w * h * 4:
        raise ValueError(f"{w}x{h} RGBA image does not fit ThumbHash's 100x100 limit")
    # One contiguous row per channel (r, g, b, a): numpy's loops then run over rows of w·h
    # values, not over w·h pixels of 3 or 4 (that layout cost 0.3 ms of a 100 px hash).
    planes = np.frombuffer(rgba, np.uint8).reshape(w * h, 4).T.astype(np.float64, order="C")
    alpha = planes[3] / 255
    total_alpha = float(np.cumsum(alpha)[-1])  # in pixel order, like the reference's
    has_alpha = total_alpha < w * h
    l_limit = 5 if has_alpha else 7
    lx = max(1, _round(l_limit * w / max(w, h)))  # halves up, as in the reference: 28×18
    ly = max(1, _round(l_limit * h / max(w, h)))  # has 5 rows of luminance terms, not 4
    lum, p, q = (c.reshape(h, w) for c in _lpq(planes[:3], alpha, total_alpha, has_alpha))
    l_dc, l_ac, l_scale = _encode_channel(lum, max(lx, 3), max(ly, 3))
    p_dc, p_ac, p_scale = _encode_channel(p, 3, 3)
    q_dc, q_ac, q_scale = _encode_channel(q, 3, 3)
    a_dc, a_ac, a_scale = (
        _encode_channel(alpha.reshape(h, w), 5, 5) if has_alpha else (1.0, [], 1.0)
    )
    landscape = w > h
    header24 = (
        _round(63 * l_dc)
        | _round(31.5 + 31.5 * p_dc) << 6
        | _round(31.5 + 31.5 * q_dc) << 12
        | _round(31 * l_scale) << 18
        | int(has_alpha) << 23
    )
    header16 = (
        (ly if landscape else lx)
        | _round(63 * p_scale) << 3
        | _round(63 * q_scale) << 9
        | int(landscape) << 15
    )
    out = bytearray(header24.to_bytes(3, "little") + header16.to_bytes(2, "little"))
    if has_alpha:
        out.append(_round(15 * a_dc) | _round(15 * a_scale) << 4)
    nibbles = [_round(15 * f) for f in (*l_ac, *p_ac, *q_ac, *a_ac)]
    for i in range(0, len(nibbles), 2):
        high = nibbles[i + 1] if i + 1 < len(nibbles) else 0
        out.append(nibbles[i] | high << 4)
    return bytes(out)


def _round(x: float) -> int:
    """JavaScript's Math.round (halves go up), which the reference uses."""
    return math.floor(x + 0.5)


def _lpq(rgb: _Floats, alpha: _Floats, total_alpha: float, has_alpha: bool) -> tuple[_Floats, ...]:
    """RGBA composited over the average colour, as luminance, yellow-blue and red-green
    (each channel one row of pixels). An opaque image is its own composite."""
    composite = (alpha / 255) * rgb
    if has_alpha:
        # summed in pixel order, as the reference does (a pairwise sum can round a flat
        # image's average the other way, and with it a DC term that sits on a half)
        avg = np.cumsum(composite, axis=1)[:, -1]
        if total_alpha > 0:
            avg = avg / total_alpha
        composite = avg[:, None] * (1 - alpha) + composite
    r, g, b = composite
    return (r + g + b) / 3, (r + g) / 2 - b, r - g


def _encode_channel(channel: _Floats, nx: int, ny: int) -> tuple[float, list[float], float]:
    """DC, AC terms normalised to 0..1, and the AC scale of one channel."""
    h, w = channel.shape
    terms = _basis(ny, h) @ (channel @ _basis(nx, w).T) / (w * h)  # [cy, cx]
    # The DC term is the mean summed in pixel order, as the reference sums it: a mean on a
    # half (15 × 0.5 for alpha, say) then rounds the reference's way, not by BLAS's order.
    terms[0, 0] = np.cumsum(channel)[-1] / (w * h)
    terms[np.abs(terms) < _NOISE] = 0.0
    ac = terms[_kept(nx, ny)][1:]  # row-major order, the reference's; the first term is DC
    scale = float(np.abs(ac).max())
    if scale > 0:
        ac = 0.5 + 0.5 / scale * ac
    return float(terms[0, 0]), ac.tolist(), scale


@functools.cache
def _basis(count: int, side: int) -> _Floats:
    """cos(π/side · c · (x + ½)) for c < count, x < side."""
    return np.cos(math.pi / side * np.arange(count)[:, None] * (np.arange(side) + 0.5))


@functools.cache
def _kept(nx: int, ny: int) -> npt.NDArray[np.bool_]:
    """The terms a hash keeps: a triangle, cx·ny < nx·(ny − cy)."""
    return np.arange(nx)[None, :] * ny < nx * (ny - np.arange(ny)[:, None])


class Header:
    """The constants at the head of a hash."""

    def __init__(self, hash_: bytes) -> None:
        if len(hash_) < 5:
            raise ValueError("a ThumbHash has at least 5 bytes")
        h24 = int.from_bytes(hash_[:3], "little")
        h16 = int.from_bytes(hash_[3:5], "little")
        self.l_dc = (h24 & 63) / 63
        self.p_dc = ((h24 >> 6) & 63) / 31.5 - 1
        self.q_dc = ((h24 >> 12) & 63) / 31.5 - 1
        self.l_scale = ((h24 >> 18) & 31) / 31
        self.has_alpha = bool(h24 >> 23)
        self.p_scale = ((h16 >> 3) & 63) / 63
        self.q_scale = ((h16 >> 9) & 63) / 63
        self.landscape = bool(h16 >> 15)
        l_max = 5 if self.has_alpha else 7
        self.lx = max(3, l_max if self.landscape else h16 & 7)
        self.ly = max(3, h16 & 7 if self.landscape else l_max)
        self.ratio = (l_max if self.landscape else h16 & 7) / (h16 & 7 if self.landscape else l_max)
        self.a_dc, self.a_scale = (
            ((hash_[5] & 15) / 15, (hash_[5] >> 4) / 15) if self.has_alpha else (1.0, 1.0)
        )


def aspect_ratio(hash_: bytes) -> float:
    """The approximate width/height of the hashed image."""
    return Header(hash_).ratio


def average_rgba(hash_: bytes) -> tuple[float, float, float, float]:
    """The average colour, each channel 0..1 (RGB not premultiplied)."""
    head = Header(hash_)
    r, g, b = _rgb(head.l_dc, head.p_dc, head.q_dc)
    return _clamp(r), _clamp(g), _clamp(b), head.a_dc


def _rgb(lum: float, p: float, q: float) -> tuple[float, float, float]:
    b = lum - 2 / 3 * p
    r = (3 * lum - b + q) / 2
    return r, r - q, b


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def decode(hash_: bytes) -> tuple[int, int, bytes]:
    """Render a hash back to a small RGBA image (at most 32 px on its long side)."""
    head = Header(hash_)
    nibbles = _nibbles(hash_[6 if head.has_alpha else 5 :])
    l_ac = _take(nibbles, _ac_count(head.lx, head.ly), head.l_scale)
    p_ac = _take(nibbles, 5, head.p_scale * 1.25)  # 1.25: saturation lost to quantising
    q_ac = _take(nibbles, 5, head.q_scale * 1.25)
    a_ac = _take(nibbles, 14, head.a_scale) if head.has_alpha else []
    w, h = (32, round(32 / head.ratio)) if head.ratio > 1 else (round(32 * head.ratio), 32)
    out = bytearray()
    for y in range(h):
        fy = [math.cos(math.pi / h * (y + 0.5) * c) for c in range(7)]
        for x in range(w):
            fx = [math.cos(math.pi / w * (x + 0.5) * c) for c in range(7)]
            lum = head.l_dc + _sum(l_ac, head.lx, head.ly, fx, fy)
            p = head.p_dc + _sum(p_ac, 3, 3, fx, fy)
            q = head.q_dc + _sum(q_ac, 3, 3, fx, fy)
            a = head.a_dc + (_sum(a_ac, 5, 5, fx, fy) if head.has_alpha else 0)
            out += bytes(int(_clamp(v) * 255) for v in (*_rgb(lum, p, q), a))
    return w, h, bytes(out)


def _ac_count(nx: int, ny: int) -> int:
    return sum(1 for cy in range(ny) for cx in range(nx) if cx * ny < nx * (ny - cy)) - 1


def _nibbles(data: bytes) -> list[int]:
    return [n for byte in data for n in (byte & 15, byte >> 4)]


def _take(nibbles: list[int], count: int, scale: float) -> list[float]:
    if len(nibbles) < count:
        raise ValueError("ThumbHash is too short")
    taken = [(n / 7.5 - 1) * scale for n in nibbles[:count]]
    del nibbles[:count]
    return taken


def _sum(ac: list[float], nx: int, ny: int, fx: list[float], fy: list[float]) -> float:
    total, j = 0.0, 0
    for cy in range(ny):
        cx = 0 if cy else 1
        while cx * ny < nx * (ny - cy):
            total += ac[j] * fx[cx] * fy[cy] * 2
            j += 1
            cx += 1
    return total
