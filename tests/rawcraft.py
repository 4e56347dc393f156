"""Hand-made camera RAW containers for tests: TIFF-based ones (DNG, CR2, NEF, ARW, RW2)
laid out the way each maker lays its IFDs and previews, a RAF with its fixed header, and a
CR3's `ftyp`. The raw data itself is filler: darkroom reads only the embedded previews."""

from __future__ import annotations

import struct

import pyvips

ASCII, SHORT, LONG, UNDEFINED = 2, 3, 4, 7
Value = str | bytes | tuple[int, list[int]]
MAKE, MODEL, ORIENTATION, EXIF_IFD, SUB_IFDS = 0x010F, 0x0110, 0x0112, 0x8769, 0x014A
WIDTH, HEIGHT, COMPRESSION, SUBFILE = 0x0100, 0x0101, 0x0103, 0x00FE
STRIP_OFFSETS, STRIP_BYTES, JPEG_OFFSET, JPEG_BYTES = 0x0111, 0x0117, 0x0201, 0x0202
DNG_VERSION, DATETIME_ORIGINAL, RW2_JPEG = 0xC612, 0x9003, 0x002E


class Tiff:
    """Lays out IFDs and blobs in order; an IFD is written after everything it points to."""

    def __init__(self, order: str = "<", header: bytes = b"") -> None:
        self.order = order
        self.out = bytearray(8 + len(header))
        self.header = header

    def blob(self, data: bytes) -> int:
        self.out += b"\0" * (len(self.out) % 2)
        offset = len(self.out)
        self.out += data
        return offset

    def ifd(self, entries: dict[int, Value], next_ifd: int = 0) -> int:
        packed = [self._entry(tag, value) for tag, value in sorted(entries.items())]
        self.out += b"\0" * (len(self.out) % 2)
        offset = len(self.out)
        self.out += struct.pack(self.order + "H", len(packed)) + b"".join(packed)
        self.out += struct.pack(self.order + "I", next_ifd)
        return offset

    def _entry(self, tag: int, value: Value) -> bytes:
        if isinstance(value, str):
            kind, count, data = ASCII, len(value) + 1, value.encode() + b"\0"
        elif isinstance(value, bytes):
            kind, count, data = UNDEFINED, len(value), value
        else:
            kind, numbers = value
            code = "H" if kind == SHORT else "I"
            count, data = len(numbers), struct.pack(self.order + code * len(numbers), *numbers)
        field = (
            data.ljust(4, b"\0")
            if len(data) <= 4
            else struct.pack(self.order + "I", self.blob(data))
        )
        return struct.pack(self.order + "HHI", tag, kind, count) + field

    def finish(self, first: int, magic: bytes | None = None) -> bytes:
        start = magic or (b"II*\0" if self.order == "<" else b"MM\0*")
        self.out[:8] = start + struct.pack(self.order + "I", first)
        self.out[8 : 8 + len(self.header)] = self.header
        return bytes(self.out)


def quadrants(width: int, height: int) -> pyvips.Image:
    """Upright test picture: red top left, green top right, blue bottom left, white."""
    w, h = width // 2, height // 2
    tile = {c: pyvips.Image.black(w, h, bands=3) + list(c) for c in
            [(220, 30, 30), (30, 200, 30), (30, 60, 220), (255, 255, 255)]}  # fmt: skip
    red, green, blue, white = tile.values()
    top = red.join(green, "horizontal")
    return (
        top.join(blue.join(white, "horizontal"), "vertical")
        .cast("uchar")
        .copy(interpretation="srgb")
    )


def preview(width: int, height: int, orientation: int = 1) -> bytes:
    """A JPEG stored width×height as a camera would for `orientation` 1 or 6 (then the
    upright picture is height×width, shown after a quarter turn clockwise)."""
    image = quadrants(width, height)
    if orientation == 6:
        image = quadrants(height, width).rot("d270")
    return bytes(image.jpegsave_buffer(Q=90, keep=0))


def tiff_raw(
    make: str,
    *,
    order: str = "<",
    orientation: int = 6,
    sensor: tuple[int, int] = (600, 400),
    jpeg: bytes | None = None,
    layout: str = "ifd0-strip",
    magic: bytes | None = None,
    header: bytes = b"",
) -> bytes:
    """A camera-like TIFF RAW: IFD0 with Make/Model/Orientation and an EXIF IFD, the
    preview where `layout` says (ifd0-strip: CR2; subifd-jpeg: NEF; ifd0-jpeg: ARW;
    rw2: JpgFromRaw; dng: DNG SubIFDs), and a raw image IFD of the sensor's size."""
    tiff = Tiff(order, header)
    jpeg = preview(*sensor, orientation=orientation) if jpeg is None else jpeg
    exif = tiff.ifd({DATETIME_ORIGINAL: "2024:05:06 07:08:09"})
    raw_data = tiff.blob(b"\x55" * 64)
    raw_ifd = tiff.ifd({SUBFILE: (LONG, [0]), WIDTH: (LONG, [sensor[0]]), HEIGHT:
                        (LONG, [sensor[1]]), COMPRESSION: (SHORT, [1]), STRIP_OFFSETS:
                        (LONG, [raw_data]), STRIP_BYTES: (LONG, [64])})  # fmt: skip
    at = tiff.blob(jpeg)
    entries: dict[int, Value] = {MAKE: make, MODEL: f"{make} Test Body",
                                 ORIENTATION: (SHORT, [orientation]),
                                 EXIF_IFD: (LONG, [exif])}  # fmt: skip
    if layout == "ifd0-strip":
        entries |= {COMPRESSION: (SHORT, [6]), STRIP_OFFSETS: (LONG, [at]),
                    STRIP_BYTES: (LONG, [len(jpeg)])}  # fmt: skip
    elif layout == "ifd0-jpeg":
        entries |= {JPEG_OFFSET: (LONG, [at]), JPEG_BYTES: (LONG, [len(jpeg)])}
    elif layout == "rw2":
        entries |= {RW2_JPEG: jpeg}
    else:
        sub = tiff.ifd({SUBFILE: (LONG, [1]), COMPRESSION: (SHORT, [7 if layout == "dng" else 6]),
                        JPEG_OFFSET if layout == "subifd-jpeg" else STRIP_OFFSETS: (LONG, [at]),
                        JPEG_BYTES if layout == "subifd-jpeg" else STRIP_BYTES:
                        (LONG, [len(jpeg)])})  # fmt: skip
        entries[SUB_IFDS] = (LONG, [raw_ifd, sub])
    if layout == "dng":
        entries[DNG_VERSION] = bytes([1, 4, 0, 0])
    first = tiff.ifd(entries, next_ifd=raw_ifd if SUB_IFDS not in entries else 0)
    return tiff.finish(first, magic)


def cr2(**kw: object) -> bytes:
    return tiff_raw("Canon", header=b"CR\x02\0\0\0\0\0", **kw)  # type: ignore[arg-type]


def raf(jpeg: bytes) -> bytes:
    """RAF: magic, version and camera fields, then at 84 the JPEG's offset and length."""
    head = b"FUJIFILMCCD-RAW 0201FF383501".ljust(84, b"\0")
    return head + struct.pack(">II", 100, len(jpeg)) + b"\0" * 8 + jpeg


def with_exif(jpeg: bytes, make: str, orientation: int) -> bytes:
    """A JPEG with an APP1 EXIF block naming the camera, orientation and capture time."""
    tiff = Tiff("<")
    exif = tiff.ifd({DATETIME_ORIGINAL: "2023:01:02 03:04:05"})
    first = tiff.ifd({MAKE: make, MODEL: f"{make} X-Test", ORIENTATION: (SHORT, [orientation]),
                      EXIF_IFD: (LONG, [exif])})  # fmt: skip
    block = b"Exif\0\0" + tiff.finish(first)
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(block) + 2) + block + jpeg[2:]


def cr3() -> bytes:
    """A CR3's opening: ISO-BMFF with the `crx ` brand."""
    ftyp = b"crx \0\0\0\x01crx isom"
    return struct.pack(">I", 8 + len(ftyp)) + b"ftyp" + ftyp + b"\0\0\0\x08free"
