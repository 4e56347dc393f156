"""Pure, synchronous libvips: original bytes → renditions and facts.

No I/O library and no event loop here: the worker runs `render` in a child process.
The format is detected from content against an allow-list; every other libvips loader
is blocked. One decode per photo (shrink-on-load to the largest rendition), every
other size cascaded from it. Outputs are upright, 8-bit sRGB, with no metadata at all.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import pyvips

from darkroom.errors import (
    CorruptImageError,
    DarkroomError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from darkroom.settings import RenditionSpec

# libvips loader classes; unblocking a class unblocks its file/buffer/source variants
ALLOWED_LOADERS = (
    "VipsForeignLoadJpeg",
    "VipsForeignLoadPng",
    "VipsForeignLoadWebp",
    "VipsForeignLoadNsgif",
    "VipsForeignLoadHeif",
)
_LOADER_NAMES = ("jpegload", "pngload", "webpload", "gifload", "heifload")
_HEIC_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs"}
_AVIF_BRANDS = {b"avif", b"avis"}
_HEIF_BRANDS = {b"mif1", b"msf1", b"miaf"}
_KEEP_NONE = 0  # ForeignKeep.NONE: no EXIF, XMP, IPTC, ICC or other metadata in outputs


class Facts(msgspec.Struct, frozen=True):
    """What the original is: source format and upright pixel size."""

    format: str
    width: int
    height: int


class Rendered(msgspec.Struct, frozen=True):
    name: str
    format: str
    ext: str
    width: int
    height: int
    data: bytes


class RenderResult(msgspec.Struct, frozen=True):
    facts: Facts
    renditions: list[Rendered]
    peak_rss_mb: int = 0  # filled in by the render process that made it


def configure() -> None:
    """Process-wide libvips policy: no operation cache, only allow-listed loaders."""
    pyvips.cache_set_max(0)
    pyvips.block_untrusted_set(True)
    pyvips.operation_block_set("VipsForeignLoad", True)
    for loader in ALLOWED_LOADERS:
        pyvips.operation_block_set(loader, False)


def sniff(data: bytes) -> str:
    """Name the format from magic bytes: jpeg, png, gif, webp, heic, avif; else raise."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[4:8] == b"ftyp":
        return _heif_kind(data)
    raise UnsupportedFormatError("content is not an allowed image format")


def _heif_kind(data: bytes) -> str:
    size = int.from_bytes(data[:4], "big")
    box = data[8 : max(16, min(size, 256))]
    brands = {box[i : i + 4] for i in range(0, len(box) - 3, 4)}
    if brands & _AVIF_BRANDS:
        return "avif"
    if brands & _HEIC_BRANDS or brands & _HEIF_BRANDS:
        return "heic"
    raise UnsupportedFormatError("ISO-BMFF file that is neither HEIC nor AVIF")


def render(data: bytes, specs: Iterable[RenditionSpec], max_pixels: int) -> RenderResult:
    """Decode once, cascade every rendition; raises DarkroomError subclasses only."""
    specs = sorted(specs, key=lambda s: s.size, reverse=True)
    fmt = sniff(data)
    try:
        base, facts = _decode(data, fmt, specs[0].size, max_pixels)
        return RenderResult(facts, list(_cascade(base, specs)))
    except DarkroomError:
        raise
    except pyvips.Error as exc:
        raise CorruptImageError(_vips_message(exc)) from None


def _vips_message(exc: pyvips.Error) -> str:
    text = (exc.detail or exc.message or "").replace("\n (", " (")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "libvips could not decode the image"


def _decode(data: bytes, fmt: str, size: int, max_pixels: int) -> tuple[pyvips.Image, Facts]:
    if fmt == "heic":
        return _decode_heic(data, size, max_pixels)
    header = pyvips.Image.new_from_buffer(data, "", access="sequential", fail_on="error")
    loader = header.get("vips-loader")
    if not loader.startswith(_LOADER_NAMES):
        raise UnsupportedFormatError(f"loader {loader} is not allowed")
    _check_pixels(header.width, header.height, max_pixels)
    width, height = _upright(header)
    # Untagged RGB is taken as sRGB already: converting sRGB→sRGB costs ~25% and changes nothing.
    tagged = header.get_typeof("icc-profile-data") or header.interpretation == "cmyk"
    image = pyvips.Image.thumbnail_buffer(
        data,
        size,
        height=size,
        size="down",
        option_string="fail_on=error",
        **(_COLOUR if tagged else {}),
    )  # thumbnail's own fail_on does not reach the loader: pass it in option_string
    return _finish(image), Facts(fmt, width, height)


# thumbnail imports with the embedded profile (CMYK falls back to a CMYK profile)
# and exports sRGB; 16-bit inputs come out 8-bit.
_COLOUR = {"output_profile": "srgb", "intent": "perceptual"}


def _upright(header: pyvips.Image) -> tuple[int, int]:
    orientation = header.get("orientation") if header.get_typeof("orientation") else 1
    if orientation in (5, 6, 7, 8):
        return header.height, header.width
    return header.width, header.height


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"{width}x{height} is {width * height} pixels, over the budget of {max_pixels}"
        )


def _decode_heic(data: bytes, size: int, max_pixels: int) -> tuple[pyvips.Image, Facts]:
    """HEVC HEIC through libheif/libde265 (pi-heif); irot/imir are applied by libheif."""
    import pi_heif

    _check_boxes(data)
    try:
        heif = pi_heif.open_heif(data, convert_hdr_to_8bit=True)
        width, height = heif.size
        _check_pixels(width, height, max_pixels)
        pixels, stride, mode = heif.data, heif.stride, heif.mode
    except DarkroomError:
        raise
    except Exception as exc:  # libheif raises plain ValueError/RuntimeError
        raise CorruptImageError(f"HEIF decode failed: {exc}") from None
    bands = len(mode)
    image = pyvips.Image.new_from_memory(bytes(pixels), stride // bands, height, bands, "uchar")
    image = image.crop(0, 0, width, height) if stride != width * bands else image
    image = image.copy(interpretation="srgb")
    icc = heif.info.get("icc_profile")
    if icc:
        image.set_type(pyvips.GValue.blob_type, "icc-profile-data", bytes(icc))
    resized = image.thumbnail_image(size, height=size, size="down", **_COLOUR)
    return _finish(resized), Facts("heic", width, height)


def _check_boxes(data: bytes) -> None:
    """Every top-level ISO-BMFF box must fit in the data: libheif fills a cut-short upload
    with flat colour instead of failing, so truncation is caught here."""
    pos = 0
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + 4], "big")
        if size == 1:
            size = int.from_bytes(data[pos + 8 : pos + 16], "big")
        elif size == 0:
            return  # the last box runs to the end of the file
        if size < 8 or pos + size > len(data):
            raise CorruptImageError(f"HEIF box at byte {pos} runs past the end of the data")
        pos += size


def _finish(image: pyvips.Image) -> pyvips.Image:
    """8-bit sRGB with alpha only where some pixel is not opaque, held in memory."""
    if image.interpretation not in ("srgb", "b-w") or image.format != "uchar":
        image = image.colourspace("srgb")
    image = image.copy_memory()
    if image.hasalpha() and image[image.bands - 1].min() >= 255:
        image = image.extract_band(0, n=image.bands - 1)
    return image


def _cascade(base: pyvips.Image, specs: list[RenditionSpec]) -> Iterable[Rendered]:
    current = base
    for spec in specs:
        if max(current.width, current.height) > spec.size:
            current = current.thumbnail_image(spec.size, height=spec.size, size="down")
            current = current.copy_memory()
        yield Rendered(
            spec.name, spec.format, spec.ext, current.width, current.height, _save(current, spec)
        )


def _save(image: pyvips.Image, spec: RenditionSpec) -> bytes:
    if spec.format == "webp":
        # effort 2 (libvips' default is 4): half the CPU at equal SSIMULACRA2, +3 % bytes
        # (docs/benchmarks.md, bench/encoders.py)
        return bytes(image.webpsave_buffer(Q=spec.quality, effort=2, keep=_KEEP_NONE))
    if spec.format == "avif":
        return bytes(image.heifsave_buffer(Q=spec.quality, compression="av1", keep=_KEEP_NONE))
    if spec.format == "png":
        return bytes(image.pngsave_buffer(keep=_KEEP_NONE))
    if image.hasalpha():
        image = image.flatten(background=[255.0] * (image.bands - 1))
    return bytes(
        image.jpegsave_buffer(Q=spec.quality, interlace=True, optimize_coding=True, keep=_KEEP_NONE)
    )


configure()
