"""ThumbHash (Evan Wallace's placeholder format): encode an RGBA image of at most 100×100 px
into ~25 bytes, and decode those bytes back (the tests use the decoder to check the hash).

A pure Python port of the reference algorithm, written for darkroom: the PyPI packages
are single, unmaintained releases. The encoder's DCT is computed separably (rows, then
columns), which gives the same coefficients as the reference's direct sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MAX_SIDE = 100


def encode(w: int, h: int, rgba: bytes) -> bytes:
    """ThumbHash bytes of `w`×`h` RGBA pixels (not premultiplied), row by row."""
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE) or len(rgba) != w * h * 4:
        raise ValueError(f"{w}x{h} RGBA image does not fit ThumbHash's 100x100 limit")
    avg, total_alpha = _average(rgba)
    has_alpha = total_alpha < w * h
    l_limit = 5 if has_alpha else 7
    lx = max(1, round(l_limit * w / max(w, h)))
    ly = max(1, round(l_limit * h / max(w, h)))
    lum, p, q, a = _lpqa(rgba, avg)
    l_dc, l_ac, l_scale = _encode_channel(lum, w, h, max(lx, 3), max(ly, 3))
    p_dc, p_ac, p_scale = _encode_channel(p, w, h, 3, 3)
    q_dc, q_ac, q_scale = _encode_channel(q, w, h, 3, 3)
    a_dc, a_ac, a_scale = _encode_channel(a, w, h, 5, 5) if has_alpha else (1.0, [], 1.0)
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


def _average(rgba: bytes) -> tuple[tuple[float, float, float], float]:
    r = g = b = total = 0.0
    for i in range(0, len(rgba), 4):
        alpha = rgba[i + 3] / 255
        r += alpha / 255 * rgba[i]
        g += alpha / 255 * rgba[i + 1]
        b += alpha / 255 * rgba[i + 2]
        total += alpha
    if total > 0:
        r, g, b = r / total, g / total, b / total
    return (r, g, b), total


def _lpqa(
    rgba: bytes, avg: tuple[float, float, float]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """RGBA composited over the average colour, as luminance, yellow-blue, red-green, alpha."""
    lum: list[float] = []
    p: list[float] = []
    q: list[float] = []
    a: list[float] = []
    for i in range(0, len(rgba), 4):
        alpha = rgba[i + 3] / 255
        r = avg[0] * (1 - alpha) + alpha / 255 * rgba[i]
        g = avg[1] * (1 - alpha) + alpha / 255 * rgba[i + 1]
        b = avg[2] * (1 - alpha) + alpha / 255 * rgba[i + 2]
        lum.append((r + g + b) / 3)
        p.append((r + g) / 2 - b)
        q.append(r - g)
        a.append(alpha)
    return lum, p, q, a


def _encode_channel(
    channel: Sequence[float], w: int, h: int, nx: int, ny: int
) -> tuple[float, list[float], float]:
    """DC, AC terms normalised to 0..1, and the AC scale of one channel."""
    fx = [[math.cos(math.pi / w * cx * (x + 0.5)) for x in range(w)] for cx in range(nx)]
    rows = [[sum(v * f for v, f in zip(channel[y * w : y * w + w], fx[cx], strict=True))
             for cx in range(nx)] for y in range(h)]  # fmt: skip
    dc, ac, scale = 0.0, [], 0.0
    for cy in range(ny):
        fy = [math.cos(math.pi / h * cy * (y + 0.5)) for y in range(h)]
        cx = 0
        while cx * ny < nx * (ny - cy):
            f = sum(rows[y][cx] * fy[y] for y in range(h)) / (w * h)
            if cx or cy:
                ac.append(f)
                scale = max(scale, abs(f))
            else:
                dc = f
            cx += 1
    if scale > 0:
        ac = [0.5 + 0.5 / scale * f for f in ac]
    return dc, ac, scale


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
