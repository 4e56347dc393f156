"""Pure, synchronous libvips: original bytes → renditions and facts.

No I/O library and no event loop here: the worker runs `render` in a child process.
The format is detected from content against an allow-list; every other libvips loader
is blocked. One decode per photo (shrink-on-load to the largest rendition), every
other size cascaded from it. Outputs are upright, 8-bit sRGB, with no metadata at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec
import numpy as np
import pyvips

from darkroom.errors import (
    CorruptImageError,
    DarkroomError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from darkroom.image import (
    applehdr,
    crops,
    exif,
    formats,
    gainmap,
    gif,
    heifedit,
    isobmff,
    placeholders,
    quality,
    raw,
    rawdecode,
    tonemap,
)
from darkroom.image.results import Decoded, Facts, Rendered, RenderResult, Source
from darkroom.image.stagetimes import OFF, Stages
from darkroom.settings import RenditionSpec

# libvips loader classes; unblocking a class unblocks its file/buffer/source variants
ALLOWED_LOADERS = (
    "VipsForeignLoadJpeg",
    "VipsForeignLoadPng",
    "VipsForeignLoadWebp",
    "VipsForeignLoadNsgif",
    "VipsForeignLoadHeif",
    "VipsForeignLoadUhdr",  # libvips picks it by content: a JPEG whose gain map libultrahdr reads
)
_LOADER_NAMES = ("jpegload", "pngload", "webpload", "gifload", "heifload", "uhdrload")
_HEIC_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs"}
_AVIF_BRANDS = {b"avif", b"avis"}
_HEIF_BRANDS = {b"mif1", b"msf1", b"miaf"}
Specs = list[RenditionSpec]


def configure() -> None:
    """Process-wide libvips policy: no operation cache, only allow-listed loaders."""
    pyvips.cache_set_max(0)
    pyvips.block_untrusted_set(True)
    pyvips.operation_block_set("VipsForeignLoad", True)
    for loader in ALLOWED_LOADERS:
        pyvips.operation_block_set(loader, False)


def sniff(data: bytes) -> str:
    """Name the format from magic bytes: jpeg, png, gif, webp, heic, avif, raw.KINDS."""
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
    if raw_kind := raw.kind(data):
        return raw_kind
    raise UnsupportedFormatError("content is not an allowed image format")


def _heif_kind(data: bytes) -> str:
    size = int.from_bytes(data[:4], "big")
    box = data[8 : max(16, min(size, 256))]
    brands = {box[i : i + 4] for i in range(0, len(box) - 3, 4)}
    if raw.is_cr3(brands):
        return "cr3"
    if brands & _AVIF_BRANDS:
        return "avif"
    if brands & _HEIC_BRANDS or brands & _HEIF_BRANDS:
        return "heic"
    raise UnsupportedFormatError("ISO-BMFF file that is neither HEIC nor AVIF")


def render(
    data: bytes, specs: Iterable[RenditionSpec], max_pixels: int, stages: Stages = OFF
) -> RenderResult:
    """Decode once, cascade every rendition; raises DarkroomError subclasses only."""
    specs = sorted(specs, key=lambda s: s.size, reverse=True)
    fmt = sniff(data)
    try:
        decode = _decode_raw if fmt in raw.KINDS else _decode
        with stages.timed("decode"):
            base, source = decode(data, fmt, specs, max_pixels)
        renditions, smallest = _cascade(base, specs, stages)
        with stages.timed("facts"):
            facts = _facts(smallest, source, hashlib.sha256(data).hexdigest())
        return RenderResult(facts, renditions, stages=stages.done or [])
    except DarkroomError:
        raise
    except pyvips.Error as exc:
        raise CorruptImageError(_vips_message(exc)) from None


def _vips_message(exc: pyvips.Error) -> str:
    text = (exc.detail or exc.message or "").replace("\n (", " (")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "libvips could not decode the image"


def _facts(smallest: pyvips.Image, source: Source, sha256: str) -> Facts:
    """From the smallest rendition's pixels (the decode when no rendition shrank it)."""
    width, height, rgba = _small_rgba(smallest, placeholders.SIDE)
    dominant = placeholders.dominant_color(rgba)
    focal = crops.focal_point(smallest)
    return Facts(
        source.format,
        source.width,
        source.height,
        has_alpha=bool(smallest.hasalpha()),
        frames=source.frames,
        source_profile=exif.profile_name(source.icc),
        thumbhash=placeholders.thumbhash_text(width, height, rgba),
        dominant_color=dominant[0] if dominant else None,
        focal_x=focal[0],
        focal_y=focal[1],
        capture=exif.read(source.exif),
        hdr=source.hdr,
        original_sha256=sha256,
    )


def _small_rgba(image: pyvips.Image, side: int) -> tuple[int, int, bytes]:
    """At most side×side px of 8-bit sRGB with alpha: width, height, pixels row by row."""
    if max(image.width, image.height) > side:
        image = image.thumbnail_image(side, height=side, size="down")
    if image.bands < 3:
        image = image.colourspace("srgb")
    if image.format != "uchar":
        image = image.cast("uchar")
    # numpy, not bandjoin/cast/copy_memory: each libvips pipeline run costs ~1 ms at any size
    pixels = np.frombuffer(image.write_to_memory(), np.uint8)
    pixels = pixels.reshape(image.height, image.width, image.bands)
    if image.bands == 3:
        pixels = np.dstack((pixels, np.full(pixels.shape[:2], 255, np.uint8)))
    return image.width, image.height, pixels.tobytes()


def _blob(image: pyvips.Image, name: str) -> bytes | None:
    return bytes(image.get(name)) if image.get_typeof(name) else None


def _decode(data: bytes, fmt: str, specs: Specs, max_pixels: int) -> tuple[pyvips.Image, Source]:
    if fmt == "heic":
        return _decode_heic(data, specs, max_pixels)
    hdr, container = None, None
    if fmt == "avif":
        original, (data, container) = data, _for_libheif(data, max_pixels, strip_transforms=False)
        hdr = gainmap.of_heif(original, container)
    header = _header(data, fmt, max_pixels)
    with_map = gainmap.check(header, max_pixels)
    limits = _HEIF_LIMITS if fmt == "avif" else {}
    width, height = _upright(header)
    size = crops.decode_edge(specs, width, height)
    # Untagged RGB is taken as sRGB already: converting sRGB→sRGB costs ~25% and changes nothing.
    tagged = header.get_typeof("icc-profile-data") or header.interpretation == "cmyk"
    tagged = tagged and hdr not in tonemap.PEAK_NITS  # a PQ/HLG signal is no profile's
    image = pyvips.Image.thumbnail_buffer(
        data,
        size,
        height=size,
        size="down",
        option_string="fail_on=error" + "".join(f",{k}=true" for k in limits),
        **(_COLOUR if tagged else {}),
    )  # thumbnail's own fail_on does not reach the loader: pass it in option_string
    frames = header.get("n-pages") if fmt in ("gif", "webp") and header.get_typeof("n-pages") else 1
    source = Source(fmt, width, height, frames, _blob(header, "icc-profile-data"),
                    _blob(header, "exif-data"), gainmap.GAINMAP if with_map else hdr)  # fmt: skip
    image = _tone_mapped(image if with_map else gainmap.drop(image), hdr, container)
    return _finish(image), source


def _decode_raw(data: bytes, fmt: str, specs: Specs, max_pixels: int) -> Decoded:
    """A RAW's largest embedded JPEG preview through the JPEG path when it covers what the
    renditions need, else its sensor data through LibRaw (rawdecode.py), else (no LibRaw, or
    raw data LibRaw refuses) a preview at least raw.USABLE_EDGE long; facts from the RAW's own
    EXIF either way. Past all three, the decoder's error, which says why."""
    needed, decoder = crops.decode_edge(specs, 0, 0), rawdecode.available()
    try:
        found = raw.preview(data, fmt, needed, max_pixels, decoder=decoder)
    except UnsupportedFormatError:
        if not decoder:
            raise
        try:
            return rawdecode.decoded(data, fmt, specs, max_pixels)
        except (UnsupportedFormatError, CorruptImageError, ImageTooLargeError) as refused:
            # a sensor past the budget (a 102 MP camera's) still renders from its preview
            found = _smaller_preview(data, fmt, needed, max_pixels, refused)
    image, source = _decode(found.jpeg, "jpeg", specs, max_pixels)
    return image, msgspec.structs.replace(source, format=fmt, exif=found.exif or source.exif)


def _smaller_preview(
    data: bytes, fmt: str, needed: int, max_pixels: int, refused: DarkroomError
) -> raw.Preview:
    try:
        return raw.preview(data, fmt, needed, max_pixels, decoder=False)
    except UnsupportedFormatError:
        raise refused from None


def _tone_mapped(
    image: pyvips.Image, hdr: str | None, container: isobmff.Container | None
) -> pyvips.Image:
    """A PQ/HLG signal tone-mapped to SDR (tonemap.py); any other image as it is."""
    code = gainmap.colour_code(container) if container else None
    if hdr not in tonemap.PEAK_NITS or code is None:
        return image
    return tonemap.to_sdr(image, hdr, code[0])


# thumbnail imports with the embedded profile (CMYK falls back to a CMYK profile)
# and exports sRGB; 16-bit inputs come out 8-bit.
_COLOUR = {"output_profile": "srgb", "intent": "perceptual"}


# libheif's fixed default limits (256 items, ...) refuse valid large grids: darkroom's own
# apply instead (the pixel budget, the structure checks, the render's memory and time limits)
_HEIF_LIMITS = {"unlimited": True}


def _for_libheif(
    data: bytes, max_pixels: int, *, strip_transforms: bool
) -> tuple[bytes, isobmff.Container]:
    """A HEIF/AVIF file as libheif should read it: the structure checks libheif does not
    make, the pixel budget over every image it will decode (a clap may crop a canvas far
    larger than what is shown), then the rewrites of heifedit.py. Transforms it strips are
    applied here, marked essential or not, as libheif would."""
    container = isobmff.check(data, essential_transforms=not strip_transforms)
    _check_pixels(*isobmff.largest_image(container), max_pixels)
    return heifedit.for_libheif(data, container, strip_transforms=strip_transforms), container


def _header(data: bytes, fmt: str, max_pixels: int) -> pyvips.Image:
    """The header, then the pixel budget on the size it shows, before any pixel is
    decoded (GIF: after the check of its first frame's structure)."""
    limits = _HEIF_LIMITS if fmt == "avif" else {}
    header = pyvips.Image.new_from_buffer(data, "", access="sequential", fail_on="error", **limits)
    loader = header.get("vips-loader")
    if not loader.startswith(_LOADER_NAMES):
        raise UnsupportedFormatError(f"loader {loader} is not allowed")
    _check_pixels(header.width, header.height, max_pixels)
    if fmt == "gif":
        gif.check_first_frame(data)
    return header


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


def _decode_heic(data: bytes, specs: Specs, max_pixels: int) -> tuple[pyvips.Image, Source]:
    """HEVC HEIC through libheif/libde265 (pi-heif), without its clap/irot/imir: libheif
    1.23 refuses a clap that crops much (heifedit.py), so darkroom applies them."""
    import pi_heif  # imported here: only HEIC renders pay for its address space

    pi_heif.options.DISABLE_SECURITY_LIMITS = True  # darkroom's own limits apply (_for_libheif)
    bare, container = _for_libheif(data, max_pixels, strip_transforms=True)
    try:
        heif = pi_heif.open_heif(bare, convert_hdr_to_8bit=True)
        width, height = heif.size  # the decoded size, before any transformative property
        _check_pixels(width, height, max_pixels)
        pixels, stride, mode = heif.data, heif.stride, heif.mode
        apple = applehdr.decoded_map(heif, heif.info.get("exif"), max_pixels)
    except DarkroomError:
        raise
    except Exception as exc:  # libheif raises plain ValueError/RuntimeError
        raise CorruptImageError(f"HEIF decode failed: {exc}") from None
    bands = len(mode)
    # libheif's own buffer, not a copy (36 MB at 12 MP): pyvips keeps a reference to the
    # memoryview, so the buffer lives as long as the image that reads it
    image = pyvips.Image.new_from_memory(pixels, stride // bands, height, bands, "uchar")
    image = image.crop(0, 0, width, height) if stride != width * bands else image
    steps = isobmff.transform_steps(container, container.primary, width, height)
    image = crops.transformed(image, steps).copy(interpretation="srgb")
    if apple is not None:  # the map turned with the base, then attached (crop/rot leave it)
        gain, boost = apple
        scaled = applehdr.scaled_steps(steps, gain.width / width, gain.height / height)
        image = applehdr.attach(image, crops.transformed(gain, scaled), boost)
    width, height = image.width, image.height
    icc = heif.info.get("icc_profile")
    if icc:
        image.set_type(pyvips.GValue.blob_type, "icc-profile-data", bytes(icc))
    hdr = gainmap.of_heif(data, container)
    size = crops.decode_edge(specs, width, height)
    resized = image.thumbnail_image(size, height=size, size="down", **_COLOUR)
    resized = _tone_mapped(resized, hdr, container)
    exif_block = heif.info.get("exif")
    source = Source("heic", width, height, 1, bytes(icc) if icc else None,
                    bytes(exif_block) if exif_block else None, hdr)  # fmt: skip
    return _finish(resized), source


def _finish(image: pyvips.Image) -> pyvips.Image:
    """8-bit sRGB with alpha only where some pixel is not opaque, held in memory."""
    if image.interpretation not in ("srgb", "b-w") or image.format != "uchar":
        image = image.colourspace("srgb")
    image = image.copy_memory()
    if image.hasalpha() and image[image.bands - 1].min() >= 255:
        image = image.extract_band(0, n=image.bands - 1)
    return image


def _cascade(
    base: pyvips.Image, specs: list[RenditionSpec], stages: Stages
) -> tuple[list[Rendered], pyvips.Image]:
    """Every rendition, largest first, each shrunk from the one before; and the last image.
    Renditions of the same pixels (a photo smaller than several boxes is never enlarged)
    and the same format and quality are one encode: identical bytes, their own objects.
    Boxes come last, each from the smallest image of the cascade that covers it."""
    current, renditions, chain = base, [], [base]
    encoded: dict[tuple[str, int, float | None, bool], Rendered] = {}  # of `current`, by format
    decided: quality.Decided = {}  # q=auto's drop per format, chosen once per photo
    for spec in (spec for spec in specs if spec.box is None):
        if max(current.width, current.height) > spec.size:
            with stages.timed("resize", spec.name):
                current = current.thumbnail_image(spec.size, height=spec.size, size="down")
                current = current.copy_memory()
            chain, encoded = [*chain, current], {}
        key = (spec.format, spec.quality, spec.target, spec.auto)
        if key not in encoded:
            with stages.timed("encode", spec.name):
                encoded[key] = _encoded(current, spec, decided)
        renditions.append(msgspec.structs.replace(encoded[key], name=spec.name))
    return renditions + [_boxed(chain, spec, stages) for spec in specs if spec.box], current


def _boxed(chain: list[pyvips.Image], spec: RenditionSpec, stages: Stages) -> Rendered:
    with stages.timed("crop", spec.name):
        image = crops.boxed(crops.source(chain, spec), spec)
    with stages.timed("encode", spec.name):
        rendered = _encoded(image, spec, {})
    return msgspec.structs.replace(rendered, crop=spec.crop)


def _encoded(image: pyvips.Image, spec: RenditionSpec, decided: quality.Decided) -> Rendered:
    data, chosen, score = quality.encoded(image, spec, _save, decided)
    return Rendered(spec.name, spec.format, spec.ext, image.width, image.height, data,
                    hashlib.sha256(data).hexdigest(), None, chosen, score)  # fmt: skip


def _save(image: pyvips.Image, spec: RenditionSpec) -> bytes:
    return formats.save(image, spec)


configure()
