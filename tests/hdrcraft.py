"""Hand-made HDR originals for tests: ISO 21496-1 gain-map JPEGs written by libvips' uhdrsave
(libultrahdr) from a real photo with brightened highlights, and hostile variants of them."""

from __future__ import annotations

import pyvips

import darkroom.image.pipeline  # noqa: F401  (its configure() admits uhdrload, as in the worker)


def ultra_hdr(jpeg: bytes, boost: float = 4.0, scale: int = 4, *, turn: bool = True) -> bytes:
    """A gain-map JPEG of this photo: its highlights up to `boost` times brighter in HDR,
    the map `scale` times smaller than the base on each side. EXIF is kept (GPS too); with
    `turn=False` the pixels stay as stored and the EXIF orientation stays in force."""
    base = pyvips.Image.new_from_buffer(jpeg, "")
    base = (base.autorot() if turn else base).colourspace("scrgb")
    luma = base[0] * 0.2126 + base[1] * 0.7152 + base[2] * 0.0722
    hdr = (base * ((luma**4) * (boost - 1) + 1)).copy(interpretation="scrgb")
    return bytes(hdr.uhdrsave_buffer(Q=90, gainmap_scale_factor=scale))


def resaved(uhdr: bytes, gainmap: pyvips.Image | None = None, **values: object) -> bytes:
    """The gain-map JPEG saved again with another map image or other ISO 21496-1 values
    (`max_content_boost=[1e30] * 3` sets gainmap-max-content-boost)."""
    image = pyvips.Image.new_from_buffer(uhdr, "").copy()
    if gainmap is not None:
        image.set_type(pyvips.GValue.image_type, "gainmap", gainmap)
    for name, value in values.items():
        image.set(f"gainmap-{name.replace('_', '-')}", value)
    return bytes(image.uhdrsave_buffer(Q=90, keep=63))


def secondary_at(uhdr: bytes) -> int:
    """Where the gain map's own JPEG starts (after the primary image's end)."""
    return uhdr.index(b"\xff\xd9\xff\xd8\xff") + 2


def loader(data: bytes) -> str:
    return str(pyvips.Image.new_from_buffer(data, "").get("vips-loader"))


def map_of(data: bytes) -> pyvips.Image:
    """The gain map a JPEG carries, decoded."""
    image = pyvips.Image.new_from_buffer(data, "")
    return pyvips.Image.new_from_buffer(image.get("gainmap-data"), "")


def correlation(a: pyvips.Image, b: pyvips.Image) -> float:
    """Pearson correlation of two one-band images of the same size."""
    a, b = a.cast("float"), b.cast("float")
    da, db = a - a.avg(), b - b.avg()
    return float((da * db).avg() / ((da * da).avg() ** 0.5 * (db * db).avg() ** 0.5))
