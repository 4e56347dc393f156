"""Structural check of a GIF's first frame, the one darkroom renders.

libvips' GIF loader (libnsgif) fills a frame whose LZW data stops short, in an otherwise
well-ended file, with transparent pixels. This module runs the LZW state machine over
the frame's code stream, counting the pixels it would produce without producing them,
and refuses a frame that yields fewer than width × height, or an invalid code. Pure
Python with no imports beyond errors, so it adds nothing to a render's address space.
"""

from __future__ import annotations

from darkroom.errors import CorruptImageError

_MAX_CODE_SIZE = 12


def check_first_frame(data: bytes) -> None:
    """Raise CorruptImageError unless the first frame's LZW data covers the whole frame."""
    try:
        width, height, code_size, stream = _first_frame(data)
    except IndexError:
        raise CorruptImageError("GIF ends inside its first frame") from None
    produced = _lzw_pixels(stream, code_size, width * height)
    if produced < width * height:
        raise CorruptImageError(
            f"GIF frame data is incomplete: {produced} of {width * height} pixels"
        )


def _first_frame(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, LZW minimum code size, code stream) of the first image."""
    pos = 13 + _table_size(data[10])
    while data[pos] == 0x21:  # extension: label, then sub-blocks
        _, pos = _sub_blocks(data, pos + 2)
    if data[pos] != 0x2C:
        raise CorruptImageError("GIF has no image")
    width = int.from_bytes(data[pos + 5 : pos + 7], "little")
    height = int.from_bytes(data[pos + 7 : pos + 9], "little")
    pos += 10 + _table_size(data[pos + 9])
    code_size = data[pos]
    if not 2 <= code_size <= 8:
        raise CorruptImageError(f"GIF LZW minimum code size {code_size} is invalid")
    stream, _ = _sub_blocks(data, pos + 1)
    return width, height, code_size, stream


def _table_size(flags: int) -> int:
    return 3 * 2 ** ((flags & 7) + 1) if flags & 0x80 else 0


def _sub_blocks(data: bytes, pos: int) -> tuple[bytes, int]:
    """The joined sub-blocks starting at pos, and the position after their terminator."""
    chunks = []
    while data[pos]:
        size = data[pos]
        if pos + 1 + size > len(data):
            raise IndexError(pos)
        chunks.append(data[pos + 1 : pos + 1 + size])
        pos += 1 + size
    return b"".join(chunks), pos + 1


def _lzw_pixels(stream: bytes, min_size: int, needed: int) -> int:
    """Pixels the code stream decodes to (stopping once `needed` is reached)."""
    clear, end = 1 << min_size, (1 << min_size) + 1
    lengths = [1] * clear + [0, 0]  # decoded length of each code; a new code is prev + 1
    size, previous, produced, bits, nbits = min_size + 1, 0, 0, 0, 0
    for byte in stream:
        bits |= byte << nbits
        nbits += 8
        while nbits >= size:
            code = bits & ((1 << size) - 1)
            bits >>= size
            nbits -= size
            if code == clear:
                del lengths[end + 1 :]
                size, previous = min_size + 1, 0
                continue
            if code == end:
                return produced
            if code < len(lengths) and code != clear and code != end:
                length = lengths[code]
            elif code == len(lengths) and previous:
                length = previous + 1  # the code being defined right now (KwKwK)
            else:
                raise CorruptImageError(f"GIF LZW code {code} is not defined")
            produced += length
            if produced >= needed:
                return produced
            if previous and len(lengths) < 1 << _MAX_CODE_SIZE:
                lengths.append(previous + 1)
                if len(lengths) == 1 << size and size < _MAX_CODE_SIZE:
                    size += 1
            previous = length
    return produced
