"""darkroom's renditions made with Pillow instead, for comparison: draft (shrink-on-load),
EXIF orientation, embedded ICC (or CMYK) converted to sRGB with LittleCMS, Lanczos cascade,
WebP q80 / progressive optimised JPEG q82. Untagged RGB is taken as sRGB, as darkroom does.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from darkroom.settings import DEFAULT_RENDITIONS, RenditionSpec, parse_renditions

SPECS = parse_renditions(DEFAULT_RENDITIONS)


def pillow_render(data: bytes, specs: Sequence[RenditionSpec] = SPECS) -> list[bytes]:
    """The same renditions with Pillow, colour-managed: embedded ICC (or CMYK) → sRGB."""
    from PIL import Image, ImageCms, ImageOps

    image = Image.open(io.BytesIO(data))
    largest = max(s.size for s in specs)
    image.draft("RGB", (largest, largest))
    image = ImageOps.exif_transpose(image)
    image = _to_srgb(image, ImageCms)
    outs = []
    for spec in sorted(specs, key=lambda s: -s.size):
        if max(image.size) > spec.size:
            image.thumbnail((spec.size, spec.size), Image.Resampling.LANCZOS, reducing_gap=2.0)
        buf = io.BytesIO()
        if spec.format == "webp":
            image.save(buf, "WEBP", quality=spec.quality)
        else:
            flat = image.convert("RGB")
            flat.save(buf, "JPEG", quality=spec.quality, progressive=True, optimize=True)
        outs.append(buf.getvalue())
    return outs


_SRGB: Any = None


def _to_srgb(image: Any, cms: Any) -> Any:
    global _SRGB
    _SRGB = _SRGB or cms.createProfile("sRGB")
    icc = image.info.get("icc_profile")
    mode = "RGBA" if "A" in image.getbands() else "RGB"
    if icc:
        source = cms.ImageCmsProfile(io.BytesIO(icc))
        return cms.profileToProfile(image, source, _SRGB, outputMode=mode)
    return image.convert(mode)  # untagged: taken as sRGB, as darkroom does
