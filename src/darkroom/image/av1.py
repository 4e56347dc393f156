"""The AV1 bitstream of a layered AVIF item (AV1 spec 5.3-5.5; AV1-ISOBMFF): its OBUs,
the operating points of its sequence header, which spatial layer an `a1op`/`lsel`
selection outputs, and the item cut down to that layer. Pure: bytes in, bytes out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from darkroom.errors import CorruptImageError

SEQUENCE_HEADER = 1
ALL_LAYERS = 0xFFFF  # lsel's "no layer selected"


class Obu(NamedTuple):
    kind: int
    spatial_id: int | None  # None: no extension header, the OBU belongs to every layer
    start: int
    body: int  # where the payload starts
    end: int


def obus(data: bytes) -> Iterator[Obu]:
    """Each OBU of a sample; every one carries its size (AV1-ISOBMFF 2.4)."""
    pos = 0
    while pos < len(data):
        header = data[pos]
        if header & 0x80 or not header & 2:
            raise CorruptImageError(f"AV1 OBU at byte {pos} is malformed or has no size")
        extended = bool(header & 4)
        spatial = (data[pos + 1] >> 3) & 3 if extended else None
        size, body = _leb128(data, pos + 1 + extended)
        if body + size > len(data):
            raise CorruptImageError(f"AV1 OBU at byte {pos} runs past the end of its item")
        yield Obu((header >> 3) & 15, spatial, pos, body, body + size)
        pos = body + size


def _leb128(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it)."""
    value = 0
    for i in range(8):
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, pos + i + 1
    raise CorruptImageError("AV1 OBU size is longer than 8 bytes")


class _Bits:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, count: int) -> int:
        value = 0
        for _ in range(count):
            value = value << 1 | (self.data[self.pos >> 3] >> (7 - (self.pos & 7))) & 1
            self.pos += 1
        return value

    def uvlc(self) -> None:
        zeros = 0
        while not self.read(1):
            zeros += 1
        self.read(zeros)


class SequenceHeader(NamedTuple):
    operating_points: list[int]  # operating_point_idc of each point
    size_at: int  # bit position of max_frame_width_minus_1
    width_bits: int
    height_bits: int


def sequence_header(payload: bytes) -> SequenceHeader:
    """The fields of a sequence header OBU's payload up to the maximum frame size."""
    bits = _Bits(payload)
    bits.read(4)  # seq_profile, still_picture
    if bits.read(1):  # reduced_still_picture_header: one operating point, all layers
        bits.read(5)
        return _frame_size(bits, [0])
    model, delay = _timing_info(bits), bits.read(1)
    points = []
    for _ in range(bits.read(5) + 1):
        points.append(bits.read(12))
        if bits.read(5) > 7:
            bits.read(1)  # seq_tier
        if model and bits.read(1):
            bits.read(2 * model + 1)  # decoder and encoder buffer delays, low_delay_mode
        if delay and bits.read(1):
            bits.read(4)
    return _frame_size(bits, points)


def _timing_info(bits: _Bits) -> int:
    """Skip timing and decoder model info; the buffer delay length in bits (0: no model)."""
    if not bits.read(1):
        return 0
    bits.read(64)  # num_units_in_display_tick, time_scale
    if bits.read(1):
        bits.uvlc()  # num_ticks_per_picture_minus_1
    if not bits.read(1):
        return 0
    length = bits.read(5) + 1
    bits.read(32 + 5 + 5)
    return length


def _frame_size(bits: _Bits, points: list[int]) -> SequenceHeader:
    width_bits, height_bits = bits.read(4) + 1, bits.read(4) + 1
    return SequenceHeader(points, bits.pos, width_bits, height_bits)


def output_layer(points: list[int], op: int | None, layer: int | None) -> int | None:
    """The spatial layer an AV1 image item outputs: the one `lsel` names, else the highest
    layer of the operating point `a1op` names; None when nothing is selected (every layer
    is decoded and the last one shown)."""
    if layer is not None and layer != ALL_LAYERS:
        return layer
    if op is None:
        return None
    if op >= len(points):
        raise CorruptImageError(f"AV1 operating point {op} does not exist ({len(points)} do)")
    spatial = points[op] >> 8
    return spatial.bit_length() - 1 if spatial else None


def cut(data: bytes, layer: int, width: int, height: int) -> bytes:
    """The item's OBUs of spatial layers up to `layer`, with the sequence header's maximum
    frame size set to width×height (the layer's own size, the item's ispe): libheif bounds
    the decode by the maximum frame size, and the layers above are gone."""
    kept = [o for o in obus(data) if o.spatial_id is None or o.spatial_id <= layer]
    return b"".join(
        with_max_size(data[o.start : o.end], o.body - o.start, width, height)
        if o.kind == SEQUENCE_HEADER
        else data[o.start : o.end]
        for o in kept
    )


def layers(data: bytes) -> int:
    """How many spatial layers the item's OBUs hold."""
    return max((o.spatial_id or 0 for o in obus(data)), default=0) + 1


def with_max_size(obu: bytes, body: int, width: int, height: int) -> bytes:
    """A sequence header OBU with its maximum frame size rewritten in place (same bits)."""
    header = sequence_header(obu[body:])
    if width > 1 << header.width_bits or height > 1 << header.height_bits:
        raise CorruptImageError(f"AV1 layer of {width}x{height} exceeds the sequence's frame size")
    out = bytearray(obu)
    at = body * 8 + header.size_at
    for value, count in ((width - 1, header.width_bits), (height - 1, header.height_bits)):
        for i in range(count):
            bit, pos = (value >> (count - 1 - i)) & 1, at + i
            out[pos >> 3] = out[pos >> 3] & ~(0x80 >> (pos & 7)) | bit << (7 - (pos & 7))
        at += count
    return bytes(out)
