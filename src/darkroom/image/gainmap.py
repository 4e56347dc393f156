"""HDR originals: which kind of HDR a photo is (the `hdr` fact) and the gain map its JPEG
renditions carry. libvips 8.18 attaches a gain-map JPEG's map to the decoded image and resizes
it with every thumbnail; this module judges that map from the header, before any pixel is
decoded, and leaves a rendition that carries it nothing else. Pure: libvips and bytes only.
"""

from __future__ import annotations

import math
import struct

import pyvips

from darkroom.errors import CorruptImageError, ImageTooLargeError
from darkroom.image import isobmff

GAINMAP, PQ, HLG = "gainmap", "pq", "hlg"
KEEP_GAINMAP = 32  # ForeignKeep.GAINMAP: the map and its ISO 21496-1 fields, no other metadata
MAX_STOPS = 16.0  # a content boost or headroom beyond 2^16 is no photo's: the map is dropped
MAX_SCALE = 16  # the base may be at most this many times the gain map's size on a side
MAP_SCALE = 4  # a rendition's map is at most a quarter of its side, as phones write theirs

# the ISO 21496-1 values uhdrsave writes back: three channels each, then two headrooms
_CHANNELS = ("max-content-boost", "min-content-boost", "gamma", "offset-sdr", "offset-hdr")
_CAPACITY = ("gainmap-hdr-capacity-min", "gainmap-hdr-capacity-max")
# every metadata field a decode may attach that is not the gain map (uhdrsave writes EXIF
# whatever `keep` says: these must be gone from the image itself)
_OTHER_METADATA = ("exif-data", "xmp-data", "iptc-data", "icc-profile-data")
_APPLE_GAINMAP = b"urn:com:apple:photo:2020:aux:hdrgainmap"
_TRANSFERS = {16: PQ, 18: HLG}  # ITU-T H.273 transfer characteristics


def carries(image: pyvips.Image) -> bool:
    """Whether libvips attached a gain map to this image (two lookups: cheap for SDR)."""
    return bool(image.get_typeof("gainmap-data") or image.get_typeof("gainmap"))


def fields(image: pyvips.Image) -> list[str]:
    """The gain-map fields libvips attached to this image (empty: no gain map)."""
    return [name for name in image.get_fields() if name.startswith("gainmap")]


def check(header: pyvips.Image, max_pixels: int) -> bool:
    """Whether the header's gain map is usable; the pixel budget counts the map's pixels
    (ImageTooLargeError). False for a map whose size or values no photo has."""
    if not header.get_typeof("gainmap-data"):
        return False
    size = _map_size(bytes(header.get("gainmap-data")))
    if size is None:
        return False
    pixels = header.width * header.height + size[0] * size[1]
    if pixels > max_pixels:
        raise ImageTooLargeError(f"{pixels} pixels with the gain map, over {max_pixels}")
    return fits(header.width, header.height, *size) and plausible(_values(header))


def _map_size(data: bytes) -> tuple[int, int] | None:
    """The gain map's size from its own JPEG header; None if that header is unreadable."""
    try:
        image = pyvips.Image.jpegload_buffer(data, access="sequential", fail_on="error")
    except pyvips.Error:
        return None
    return (image.width, image.height) if image.bands in (1, 3) else None


def fits(width: int, height: int, map_width: int, map_height: int) -> bool:
    """A gain map covers its base: the same aspect ratio (±1 px of the map) at a scale
    between 1 and MAX_SCALE."""
    if not (0 < map_width <= width and 0 < map_height <= height):
        return False
    scale = width / map_width
    return scale <= MAX_SCALE and abs(height / scale - map_height) <= 1


def _values(header: pyvips.Image) -> list[float]:
    names = [f"gainmap-{name}" for name in _CHANNELS] + list(_CAPACITY)
    if not all(header.get_typeof(name) for name in names):
        return [math.nan]
    found: list[float] = []
    for name in names:
        value = header.get(name)
        found += value if isinstance(value, list) else [value]
    return found


def plausible(values: list[float]) -> bool:
    """ISO 21496-1 values in the order of `_values`: boosts and headrooms within ±MAX_STOPS
    stops, min ≤ max, gamma positive, offsets small, every value finite."""
    if len(values) != 17 or not all(math.isfinite(v) for v in values):
        return False
    top, bottom, gamma, offsets = values[0:3], values[3:6], values[6:9], values[9:15]
    low, high = values[15:17]
    if any(not 0 < b <= t for b, t in zip(bottom, top, strict=True)) or not 0 < low <= high:
        return False
    limit = 2.0**MAX_STOPS
    in_range = all(2.0**-MAX_STOPS <= v <= limit for v in [*top, *bottom, low, high])
    return in_range and all(0 < g <= 16 for g in gamma) and all(abs(o) <= 1 for o in offsets)


def drop(image: pyvips.Image) -> pyvips.Image:
    """The image without its gain map: an SDR image as any other."""
    if not carries(image):
        return image
    image = image.copy()
    for name in fields(image):
        image.remove(name)
    return image


def bare(image: pyvips.Image) -> pyvips.Image:
    """The image with its gain map and no other metadata, ready for uhdrsave."""
    names = [name for name in _OTHER_METADATA if image.get_typeof(name)]
    if not names:
        return image
    image = image.copy()
    for name in names:
        image.remove(name)
    return image


def save_jpeg(image: pyvips.Image, quality: int) -> bytes:
    """An Ultra HDR JPEG: the SDR base, its gain map and ISO 21496-1 fields, nothing else."""
    data = bytes(bare(capped(image)).uhdrsave_buffer(Q=quality, keep=KEEP_GAINMAP))
    return without_base_blocks(data)


def without_base_blocks(jpeg: bytes) -> bytes:
    """The JPEG without the EXIF and ICC blocks uhdrsave writes ahead of the base's MPF index
    (~800 bytes: a sixth of a 320 px rendition). The gain map's offset counts from the index,
    so it holds; the base's own size in the index shrinks by what was cut. Unchanged when
    the layout is not the one expected."""
    segments: list[bytes] = []
    position, mpf = 2, None
    while jpeg[position : position + 1] == b"\xff" and jpeg[position + 1] != 0xDA:
        (length,) = struct.unpack(">H", jpeg[position + 2 : position + 4])
        segment = jpeg[position : position + 2 + length]
        mpf = len(segments) if mpf is None and segment[4:8] == b"MPF\0" else mpf
        segments.append(segment)
        position += 2 + length
    if mpf is None:
        return jpeg
    cut = [i for i in range(mpf) if segments[i][4:10] == b"Exif\0\0" or
           segments[i][4:16] == b"ICC_PROFILE\0"]  # fmt: skip
    removed = sum(len(segments[i]) for i in cut)
    index = _shrunk_first_entry(segments[mpf], removed)
    if index is None:
        return jpeg
    kept = [index if i == mpf else seg for i, seg in enumerate(segments) if i not in cut]
    return jpeg[:2] + b"".join(kept) + jpeg[position:]


def _shrunk_first_entry(segment: bytes, removed: int) -> bytes | None:
    """The MPF segment with its first MP entry's size (the base image) less `removed`."""
    tiff = 8  # marker, length, "MPF\0"
    order = {b"MM": ">", b"II": "<"}.get(segment[tiff : tiff + 2])
    if order is None:
        return None
    (ifd,) = struct.unpack(order + "I", segment[tiff + 4 : tiff + 8])
    (count,) = struct.unpack(order + "H", segment[tiff + ifd : tiff + ifd + 2])
    for at in range(tiff + ifd + 2, tiff + ifd + 2 + 12 * count, 12):
        tag, _, _, offset = struct.unpack(order + "HHII", segment[at : at + 12])
        if tag == 0xB002:  # MPEntry: attribute, size, offset, two dependents (16 bytes each)
            size_at = tiff + offset + 4
            (size,) = struct.unpack(order + "I", segment[size_at : size_at + 4])
            new = struct.pack(order + "I", size - removed)
            return segment[:size_at] + new + segment[size_at + 4 :]
    return None


def capped(image: pyvips.Image) -> pyvips.Image:
    """The image with a gain map of at most 1/MAP_SCALE of its side: a map is smooth, and a
    full-size one costs a rendition 40-70 % more bytes for no visible gain (docs/hdr.md)."""
    gain = image.get_gainmap()
    width, height = round(image.width / MAP_SCALE), round(image.height / MAP_SCALE)
    if gain is None or gain.width <= width or min(width, height) < 1:
        return image
    image = image.copy()
    smaller = gain.thumbnail_image(width, height=height, size="force")
    image.set_type(pyvips.GValue.image_type, "gainmap", smaller)
    return image


def of_heif(data: bytes, container: isobmff.Container) -> str | None:
    """The `hdr` fact of a HEIF/AVIF file: a gain map (Apple's auxiliary image, or an AVIF
    `tmap` of a version darkroom knows), else the primary image's PQ or HLG transfer."""
    auxiliary = [p for item in container.items for k, p, _ in container.props(item) if k == b"auxC"]
    if any(payload[4:].rstrip(b"\0") == _APPLE_GAINMAP for payload in auxiliary):
        return GAINMAP
    for item, kind in container.items.items():
        if kind == b"tmap" and known_tmap(_item_data(data, container, item)):
            return GAINMAP
    return _transfer(container)


def _item_data(data: bytes, container: isobmff.Container, item: int) -> bytes:
    try:
        return isobmff.item_data(data, container, item)
    except (CorruptImageError, LookupError, ValueError, struct.error):
        return b""  # a map without readable data is ignored, never the photo's failure


def known_tmap(data: bytes) -> bool:
    """An ISO 21496-1 `tmap` item of version 0 whose minimum version is 0: any other is to
    be ignored, as the specification requires of a reader that does not know it."""
    if len(data) < 5 or data[0] != 0:
        return False
    (minimum_version,) = struct.unpack(">H", data[1:3])
    return bool(minimum_version == 0)


def _transfer(container: isobmff.Container) -> str | None:
    code = colour_code(container)
    return _TRANSFERS.get(code[1]) if code else None


def colour_code(container: isobmff.Container) -> tuple[int, int] | None:
    """The primary image's H.273 (colour primaries, transfer) from its `nclx` box."""
    for kind, payload, _ in container.props(container.primary):
        if kind == b"colr" and payload[:4] == b"nclx" and len(payload) >= 11:
            primaries, transfer = struct.unpack(">HH", payload[4:8])
            return primaries, transfer
    return None
