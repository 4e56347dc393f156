"""A camera RAW decoded by LibRaw (rawpy), for a file whose embedded previews are all too
small for its largest rendition (image/raw.py picks those): the sensor's data demosaiced,
white-balanced as the camera metered it, in sRGB, turned upright by the file's orientation.

The pixel budget is checked on the sensor's size LibRaw reads from the header, before any
raw data is unpacked. When half the sensor's size still covers the largest rendition, LibRaw
decodes at half size (each 2×2 Bayer cell one pixel, no demosaic): a quarter of the memory
and a fraction of the time, and nothing a rendition could show is lost.
"""

from __future__ import annotations

import errno
import functools
import io
from collections.abc import Sequence

import numpy as np
import pyvips

from darkroom.errors import (
    CorruptImageError,
    DarkroomError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from darkroom.image import crops, raw, tones
from darkroom.image.results import Decoded, Source
from darkroom.settings import RenditionSpec


def decoded(data: bytes, fmt: str, specs: Sequence[RenditionSpec], max_pixels: int) -> Decoded:
    """The RAW's pixels shrunk to what the renditions need (a cropped box's cover included,
    judged on the sensor's shape), and what its header says: the sensor's upright size, the
    RAW's own EXIF (for the facts)."""
    image, width, height = decode(data, fmt, specs, max_pixels)
    needed = crops.decode_edge(specs, width, height)
    image = image.thumbnail_image(needed, height=needed, size="down").copy_memory()
    image = tones.matched(image, _camera_look(data, fmt, max_pixels)).copy_memory()
    return image, Source(fmt, width, height, exif=raw.exif_of(data))


def _camera_look(data: bytes, fmt: str, max_pixels: int) -> pyvips.Image | None:
    """The camera's rendering of the frame, small: its largest embedded preview, whatever its
    size; None when it has none (or none that decodes: the tones are then LibRaw's)."""
    try:
        jpeg = raw.camera_jpeg(data, fmt, max_pixels)
        # in sRGB, as the decode is: a preview with an ICC profile of another space is
        # converted (one without a profile is taken as sRGB, as the JPEG path takes it); and
        # strictly, as every decode here: a cut preview's grey fill would bend the curves
        look = pyvips.Image.thumbnail_buffer(
            jpeg, tones.SAMPLE_EDGE, export_profile="srgb", option_string="fail_on=error"
        )
        return look.copy_memory()
    except (DarkroomError, pyvips.Error):
        return None


@functools.cache
def available() -> bool:
    """Whether LibRaw can be loaded here (rawpy installed, its library found)."""
    try:
        import rawpy  # noqa: F401
    except ImportError:
        return False
    return True


def decode(
    data: bytes, fmt: str, specs: Sequence[RenditionSpec], max_pixels: int
) -> tuple[pyvips.Image, int, int]:
    """Upright 8-bit sRGB pixels, and the full upright size they stand for (a half-size
    decode is half of it). Raises UnsupportedFormatError for what LibRaw does not know,
    ImageTooLargeError past the budget, CorruptImageError for data it cannot decode, and
    MemoryError for buffers the render process's limit refused (renderproc.py: out_of_memory)."""
    import rawpy

    with rawpy.RawPy() as libraw:
        try:
            libraw.open_buffer(io.BytesIO(data))
            width, height = _checked_size(libraw, max_pixels)
            half = raw.half_size(width, height, crops.decode_edge(specs, width, height))
            libraw.unpack()
            rgb = libraw.postprocess(use_camera_wb=True, half_size=half, output_bps=8,
                                     output_color=rawpy.ColorSpace.sRGB)  # fmt: skip
        except (rawpy.LibRawUnsufficientMemoryError, rawpy.LibRawMemPoolOverflowError):
            raise MemoryError("LibRaw could not allocate its buffers") from None
        except rawpy.LibRawTooBigError:
            raise ImageTooLargeError(f"{fmt.upper()}: LibRaw refuses its size") from None
        except rawpy.LibRawFileUnsupportedError:
            raise UnsupportedFormatError(
                f"{fmt.upper()}: no embedded preview covers the renditions and LibRaw does"
                " not decode this file's raw data"
            ) from None
        except rawpy.LibRawError as exc:
            raise CorruptImageError(f"{fmt.upper()}: LibRaw could not decode the raw data"
                                    f" ({_said(exc)})"[:300]) from None  # fmt: skip
        except OSError as exc:  # rawpy's own allocation of the output image
            if _errno(exc) == errno.ENOMEM:
                raise MemoryError("LibRaw could not allocate its output image") from None
            raise CorruptImageError(f"{fmt.upper()}: LibRaw failed ({exc})"[:300]) from None
    return _image(rgb), *_upright(width, height, rgb.shape)


def _upright(width: int, height: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """The sensor's visible size as the output is turned: LibRaw applied the orientation,
    and a transposing one (5-8) made a landscape sensor's output portrait."""
    return (height, width) if (shape[1] > shape[0]) != (width > height) else (width, height)


def _errno(exc: OSError) -> int | None:
    """rawpy raises OSError((code, message)): one tuple argument, so `errno` stays None."""
    if exc.errno is not None:
        return exc.errno
    first = exc.args[0] if exc.args else None
    return first[0] if isinstance(first, tuple) and first and isinstance(first[0], int) else None


def _said(exc: BaseException) -> str:
    """LibRaw's message (rawpy passes it as bytes)."""
    said = exc.args[0] if exc.args else type(exc).__name__
    return said.decode(errors="replace") if isinstance(said, bytes) else str(said)


def _checked_size(libraw: object, max_pixels: int) -> tuple[int, int]:
    """The visible sensor area, after the pixel budget (over the raw frame, margins
    included: that is what unpack allocates)."""
    sizes = libraw.sizes  # type: ignore[attr-defined]
    frame = sizes.raw_width * sizes.raw_height
    if not sizes.width or not sizes.height:
        raise CorruptImageError("RAW header without an image size")
    if max(frame, sizes.width * sizes.height) > max_pixels:
        raise ImageTooLargeError(
            f"RAW sensor {sizes.raw_width}x{sizes.raw_height} is {frame} pixels,"
            f" over the budget of {max_pixels}"
        )
    return int(sizes.width), int(sizes.height)


def _image(rgb: np.ndarray) -> pyvips.Image:
    height, width, bands = rgb.shape
    pixels = np.ascontiguousarray(rgb, dtype=np.uint8)
    image = pyvips.Image.new_from_memory(pixels.data, width, height, bands, "uchar")
    return image.copy(interpretation="srgb").copy_memory()
