"""Hand-made camera RAW containers for tests: TIFF-based ones (DNG, CR2, NEF, ARW, RW2)
laid out the way each maker lays its IFDs and previews, a RAF with its fixed header, and a
CR3's `ftyp`. Their raw data is filler, read by nothing. `bayer_dng` is a DNG whose raw data
is real: a picture mosaicked through an RGGB filter, which LibRaw demosaics back."""

from __future__ import annotations

import struct

import numpy as np
import pyvips

from tests.heifcraft import box
from tests.heifcraft import full as full_box

BYTE, ASCII, SHORT, LONG, RATIONAL, UNDEFINED, SRATIONAL = 1, 2, 3, 4, 5, 7, 10
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
            code = {BYTE: "B", SHORT: "H", RATIONAL: "I", SRATIONAL: "i"}.get(kind, "I")
            data = struct.pack(self.order + code * len(numbers), *numbers)
            count = len(numbers) // 2 if kind in (RATIONAL, SRATIONAL) else len(numbers)
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


def cr3_with(
    jpeg: bytes,
    make: str = "Canon",
    orientation: int = 1,
    full: bytes | None = None,
    offsets: bytes = b"co64",
    tracks: int = 1,
) -> bytes:
    """A CR3 laid out as Canon's (the layout LibRaw and exiftool read): CMT1 (IFD0: make,
    model, orientation), CMT2 (the EXIF IFD: capture time) and CMT4 (the GPS IFD) in Canon's
    uuid box in `moov`, with `tracks` tracks whose first sample is `full` (the camera's
    full-size JPEG) when given, located by an `offsets` box (`co64` or `stco`), `jpeg` in
    `PRVW` in the preview uuid box, and sensor data LibRaw cannot read."""
    canon = bytes.fromhex("85c0b687820f11e08111f4ce462b6a48")
    cmts = box(b"CMT1", _ifd({MAKE: make, MODEL: f"{make} EOS Test",
                              ORIENTATION: (SHORT, [orientation])}))  # fmt: skip
    cmts += box(b"CMT2", _ifd({DATETIME_ORIGINAL: "2023:01:02 03:04:05"}))
    cmts += box(b"CMT4", _ifd({1: "N", 2: (RATIONAL, [48, 1, 51, 1, 0, 1]), 3: "E",
                               4: (RATIONAL, [2, 1, 21, 1, 0, 1])}))  # fmt: skip
    size = pyvips.Image.new_from_buffer(jpeg, "")
    prvw = struct.pack(">IHHHHI", 0, 1, size.width, size.height, 1, len(jpeg)) + jpeg
    preview_id = bytes.fromhex("eaf42b5e1c984b88b9fbb7dc406e4d16")
    preview = box(b"uuid", preview_id + bytes(8) + box(b"PRVW", prvw))
    sample = full or bytes(64)

    def moov(offset: int) -> bytes:
        table = full_box(b"stsz", struct.pack(">II", 0, 1) + struct.pack(">I", len(sample)))
        entry = ">Q" if offsets == b"co64" else ">I"
        table += full_box(offsets, struct.pack(">I", 1) + struct.pack(entry, offset))
        track = box(b"trak", box(b"mdia", box(b"minf", box(b"stbl", table))))
        return box(b"moov", box(b"uuid", canon + cmts) + track * tracks)

    head = cr3()[:-8]
    start = len(head) + len(moov(0)) + len(preview) + 8  # the sample, first in `mdat`
    return head + moov(start) + preview + box(b"mdat", sample)


def _ifd(entries: dict[int, Value]) -> bytes:
    tiff = Tiff("<")
    return tiff.finish(tiff.ifd(entries))


# XYZ (D65) to linear sRGB: a camera whose raw channels are linear sRGB's, for ColorMatrix1
_XYZ_TO_SRGB = (3.2406, -1.5372, -0.4986, -0.9689, 1.8758, 0.0415, 0.0557, -0.2040, 1.0570)
WHITE = 4095  # a 12-bit sensor's white level


def _rationals(values: tuple[float, ...], denominator: int = 10_000) -> list[int]:
    return [n for v in values for n in (round(v * denominator), denominator)]


def mosaic(image: pyvips.Image) -> np.ndarray:
    """The picture as a sensor behind an RGGB Bayer filter records it: linear light, 12 bits,
    one colour per photosite (even width and height)."""
    rgb = np.ndarray(buffer=image.write_to_memory(), dtype=np.uint8,
                     shape=(image.height, image.width, image.bands))[..., :3]  # fmt: skip
    linear = (rgb / 255.0) ** 2.2 * WHITE
    height, width = image.height // 2 * 2, image.width // 2 * 2
    sensor = np.empty((height, width), dtype="<u2")
    for dy, dx, channel in ((0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 2)):
        sensor[dy::2, dx::2] = linear[dy:height:2, dx:width:2, channel]
    return sensor


def bayer_dng(
    image: pyvips.Image, orientation: int = 1, jpeg: bytes | None = None, make: str = "Leica"
) -> bytes:
    """A DNG of `image` as stored by the sensor (orientation applies on display), its raw
    data uncompressed 16-bit CFA in IFD0 and, given `jpeg`, that preview in a SubIFD."""
    sensor = mosaic(image)
    height, width = sensor.shape
    tiff = Tiff("<")
    exif = tiff.ifd({DATETIME_ORIGINAL: "2025:09:10 11:12:13"})
    data = tiff.blob(sensor.tobytes())
    entries: dict[int, Value] = {
        SUBFILE: (LONG, [0]), WIDTH: (LONG, [width]), HEIGHT: (LONG, [height]),
        0x0102: (SHORT, [16]), COMPRESSION: (SHORT, [1]), 0x0106: (SHORT, [32803]),
        MAKE: make, MODEL: f"{make} Bayer Test", ORIENTATION: (SHORT, [orientation]),
        0x0115: (SHORT, [1]), 0x0116: (LONG, [height]), STRIP_OFFSETS: (LONG, [data]),
        STRIP_BYTES: (LONG, [sensor.nbytes]), 0x011C: (SHORT, [1]), EXIF_IFD: (LONG, [exif]),
        0x828D: (SHORT, [2, 2]), 0x828E: (BYTE, [0, 1, 1, 2]),  # CFA: R G / G B
        DNG_VERSION: (BYTE, [1, 4, 0, 0]), 0xC614: f"{make} Bayer Test",
        0xC621: (SRATIONAL, _rationals(_XYZ_TO_SRGB)), 0xC65A: (SHORT, [21]),  # D65
        0xC628: (RATIONAL, _rationals((1.0, 1.0, 1.0))),  # as shot neutral
        0xC61A: (LONG, [0]), 0xC61D: (LONG, [WHITE]),  # black and white levels
    }  # fmt: skip
    if jpeg is not None:
        at = tiff.blob(jpeg)
        sub = tiff.ifd({SUBFILE: (LONG, [1]), COMPRESSION: (SHORT, [7]),
                        STRIP_OFFSETS: (LONG, [at]), STRIP_BYTES: (LONG, [len(jpeg)])})  # fmt: skip
        entries[SUB_IFDS] = (LONG, [sub])
    return tiff.finish(tiff.ifd(entries))
