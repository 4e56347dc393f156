"""Hand-made EXIF blocks for tests: well-formed ones with chosen tags, and hostile ones
(huge counts, loops, offsets past the end), spliced into a real JPEG as its APP1 segment."""

from __future__ import annotations

import struct

ASCII, SHORT, LONG, RATIONAL = 2, 3, 4, 5


def tiff(entries: list[tuple[int, int, int, bytes]], sub: dict[int, bytes] | None = None) -> bytes:
    """A little-endian TIFF block with one IFD of raw (tag, type, count, value/offset) entries;
    each value is 4 bytes, used as is (so offsets and counts can lie)."""
    ifd = struct.pack("<H", len(entries))
    for tag, kind, count, value in entries:
        ifd += struct.pack("<HHI", tag, kind, count) + value.ljust(4, b"\0")[:4]
    return (
        b"II*\0"
        + struct.pack("<I", 8)
        + ifd
        + struct.pack("<I", 0)
        + b"".join((sub or {}).values())
    )


def ascii_entries(
    tags: dict[int, str], start: int
) -> tuple[list[tuple[int, int, int, bytes]], bytes]:
    """ASCII entries whose text lives after the IFD, at `start` onwards."""
    entries, blob = [], b""
    for tag, text in tags.items():
        data = text.encode() + b"\0"
        if len(data) <= 4:  # small values sit in the entry itself
            entries.append((tag, ASCII, len(data), data))
            continue
        entries.append((tag, ASCII, len(data), struct.pack("<I", start + len(blob))))
        blob += data
    return entries, blob


def with_exif(jpeg: bytes, block: bytes) -> bytes:
    """`jpeg` with its APP1 (if any) replaced by `Exif\\0\\0` + block."""
    payload = b"Exif\0\0" + block
    segment = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    body = jpeg[2:]
    if body[:2] == b"\xff\xe1":
        body = body[2 + struct.unpack(">H", body[2:4])[0] :]
    return jpeg[:2] + segment + body


def hostile_blocks() -> dict[str, bytes]:
    """EXIF blocks a hostile or broken producer could send."""
    ifd_at = 8
    return {
        # 65535 entries announced, a handful present
        "huge-entry-count": b"II*\0" + struct.pack("<IH", ifd_at, 0xFFFF) + b"\x0f\x01\x02\0" * 3,
        # a value of 2^31 LONGs at an offset past the end
        "huge-value-count": tiff([(0x010F, LONG, 0x7FFFFFFF, struct.pack("<I", 0x7FFFFF00))]),
        # the EXIF sub-IFD pointer points back at the main IFD: a loop
        "ifd-loop": tiff(
            [
                (0x8769, LONG, 1, struct.pack("<I", ifd_at)),
                (0x8825, LONG, 1, struct.pack("<I", ifd_at)),
            ]
        ),
        # the first IFD is past the end of the block
        "ifd-past-end": b"II*\0" + struct.pack("<I", 0xFFFFFFF0),
        # not TIFF at all
        "garbage": bytes(range(256)) * 4,
        # a make whose text runs past the end
        "text-past-end": tiff([(0x010F, ASCII, 4000, struct.pack("<I", 20))]),
    }
