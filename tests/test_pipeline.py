"""Pure tests of `darkroom.image.pipeline.render`: bytes in, files out."""

from __future__ import annotations

import random
from functools import cache

import pytest
import pyvips

from darkroom.errors import (
    CorruptImageError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from darkroom.image.pipeline import render
from darkroom.image.results import Rendered, RenderResult
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions
from tests.conftest import PHOTOS
from tests.imagecheck import jpeg_markers, metadata_leaks, webp_chunks

DEFAULTS = parse_renditions(DEFAULT_RENDITIONS)
MAX_PIXELS = Settings().max_pixels
ALL_PHOTOS = sorted(p.name for p in PHOTOS.iterdir() if p.suffix != ".md")
LANDSCAPES = [f"Landscape_{i}.jpg" for i in range(1, 9)]
WITH_GPS = [
    "iphone_hdr_NO.jpg",
    "avif-orientation-6.avif",
    "jpg-24bit-icc-adobe-rgb.jpg",
    "iphone_13_pro_max.HEIC",
]
FACTS = {name: ("jpeg", 1800, 1200) for name in LANDSCAPES} | {
    "4.webp": ("webp", 1024, 772),
    "Channel_digital_image_CMYK_color.jpg": ("jpeg", 500, 333),
    "animated-loop-3.gif": ("gif", 370, 285),
    "avif-orientation-6.avif": ("avif", 3024, 4032),
    "embedgravitybird.png": ("png", 576, 384),
    "iphone_13_pro_max.HEIC": ("heic", 3024, 4032),
    "iphone_hdr_NO.jpg": ("jpeg", 3264, 2448),
    "jpg-24bit-icc-adobe-rgb.jpg": ("jpeg", 1900, 1263),
    "png-alpha-64bit.png": ("png", 1350, 600),
}
MAGIC = {
    "webp": lambda d: d[:4] == b"RIFF" and d[8:12] == b"WEBP",
    "jpeg": lambda d: d[:3] == b"\xff\xd8\xff",
    "png": lambda d: d[:8] == b"\x89PNG\r\n\x1a\n",
    "avif": lambda d: d[4:12] == b"ftypavif",
}


def photo(name: str) -> bytes:
    return (PHOTOS / name).read_bytes()


@cache
def rendered(name: str) -> RenderResult:
    """The default renditions of one sample photo, rendered once per test session."""
    return render(photo(name), DEFAULTS, MAX_PIXELS)


def pick(result: RenderResult, name: str, fmt: str) -> Rendered:
    return next(r for r in result.renditions if (r.name, r.format) == (name, fmt))


def decode(data: bytes, **options: object) -> pyvips.Image:
    return pyvips.Image.new_from_buffer(data, "", **options)


def mad(a: pyvips.Image, b: pyvips.Image) -> float:
    """Mean absolute pixel difference of two same-sized images."""
    return float((a.cast("float") - b.cast("float")).abs().avg())


def assert_rendition(out: Rendered, size: int, upright: tuple[int, int]) -> None:
    """Declared format, never upscaled, fields match the file, aspect ratio kept."""
    assert MAGIC[out.format](out.data), (out.name, out.format, out.data[:12])
    image = decode(out.data)
    assert (image.width, image.height) == (out.width, out.height)
    assert max(out.width, out.height) == min(size, max(upright))
    assert abs(out.width * upright[1] / upright[0] - out.height) <= 1


@pytest.mark.parametrize("name", ALL_PHOTOS)
def test_every_photo_gets_the_four_default_renditions(name: str) -> None:
    """Each sample photo yields thumb/medium/medium/large, each a valid file of its size."""
    result = rendered(name)
    assert sorted((r.name, r.format) for r in result.renditions) == sorted(
        (s.name, s.format) for s in DEFAULTS
    )
    for spec in DEFAULTS:
        out = pick(result, spec.name, spec.format)
        assert out.ext == spec.ext
        assert_rendition(out, spec.size, (result.facts.width, result.facts.height))


@pytest.mark.parametrize("name", ALL_PHOTOS)
def test_facts_name_the_format_and_upright_size(name: str) -> None:
    """Facts give the sniffed format and the size as the photo is meant to be seen."""
    facts = rendered(name).facts
    assert (facts.format, facts.width, facts.height) == FACTS[name]


@pytest.mark.parametrize("name", WITH_GPS)
def test_outputs_carry_no_metadata(name: str) -> None:
    """No EXIF/GPS/XMP/IPTC/ICC survives, neither as decoded fields nor in the file bytes."""
    assert b"GPS" in photo(name) or b"Exif" in photo(name)  # the input really has some
    for out in rendered(name).renditions:
        assert metadata_leaks(out.data) == [], (out.name, out.format)
        if out.format == "webp":  # the chunk walk saw the image itself
            assert {b"VP8 ", b"VP8L"} & set(webp_chunks(out.data))
        else:  # the marker walk reached the quantisation tables and the scan
            assert {0xDB, 0xDA} <= set(jpeg_markers(out.data))


def test_all_eight_orientations_come_out_alike() -> None:
    """Landscape_1..8 (EXIF orientations 1-8) all render to the same upright picture."""
    first = decode(pick(rendered("Landscape_1.jpg"), "thumb", "webp").data)
    for name in LANDSCAPES[1:]:
        other = decode(pick(rendered(name), "thumb", "webp").data)
        assert (other.width, other.height) == (first.width, first.height)
        assert mad(first, other) < 8, name  # measured 2.5-2.9: only the drawn digit differs
    for wrong in (first.fliphor(), first.flipver(), first.rot180()):
        assert mad(first, wrong) > 40  # measured 71-86: the check can tell


def test_avif_irot_rotation_is_applied() -> None:
    """An AVIF rotated by its irot box renders portrait, as it is meant to be seen."""
    for out in rendered("avif-orientation-6.avif").renditions:
        assert out.height > out.width, out.name


@pytest.mark.parametrize(
    "name", ["Channel_digital_image_CMYK_color.jpg", "jpg-24bit-icc-adobe-rgb.jpg"]
)
def test_cmyk_and_wide_gamut_become_srgb(name: str) -> None:
    """CMYK and Adobe RGB photos come out as plain 3-band 8-bit sRGB."""
    for out in rendered(name).renditions:
        image = decode(out.data)
        assert (image.bands, image.interpretation, image.format) == (3, "srgb", "uchar")


def test_adobe_rgb_profile_is_converted_not_ignored() -> None:
    """Adobe RGB pixels are converted to sRGB, so they differ from a profile-blind resize."""
    name = "jpg-24bit-icc-adobe-rgb.jpg"
    ours = render(photo(name), parse_renditions("t:320:png"), MAX_PIXELS).renditions[0]
    blind = pyvips.Image.thumbnail_buffer(photo(name), 320).copy_memory()
    assert (blind.width, blind.height) == (ours.width, ours.height)
    assert mad(decode(ours.data), blind) > 4  # measured 7.1


def test_transparent_png_keeps_alpha_in_webp_and_flattens_on_white_in_jpeg() -> None:
    """Real transparency survives in WebP; JPEG has none, so it is flattened onto white."""
    result = rendered("png-alpha-64bit.png")
    webp = decode(pick(result, "thumb", "webp").data)
    assert webp.bands == 4
    assert webp[3].min() == 0
    jpeg = decode(pick(result, "medium", "jpeg").data)
    assert jpeg.bands == 3
    assert min(jpeg.getpoint(0, 0)) > 245  # the corner was transparent in the original
    assert decode(photo("png-alpha-64bit.png")).getpoint(0, 0)[3] == 0


def test_opaque_alpha_is_dropped() -> None:
    """A PNG whose alpha channel is fully opaque renders to WebP without an alpha band."""
    for out in rendered("embedgravitybird.png").renditions:
        assert decode(out.data).bands == 3, out.name


def test_sixteen_bit_input_gives_eight_bit_output() -> None:
    """A 16-bit PNG renders to 8 bits per channel, even into PNG which could hold 16."""
    assert decode(photo("png-alpha-64bit.png")).format == "ushort"
    out = render(photo("png-alpha-64bit.png"), parse_renditions("p:320:png"), MAX_PIXELS)
    assert decode(out.renditions[0].data).format == "uchar"


def test_animated_gif_renders_its_first_frame_only() -> None:
    """An animated GIF gives a still image: one page, equal to the first frame."""
    out = render(photo("animated-loop-3.gif"), parse_renditions("p:400:png"), MAX_PIXELS)
    still = decode(out.renditions[0].data)
    assert (still.width, still.height) == (370, 285)  # not a strip of all 10 frames
    frames = decode(photo("animated-loop-3.gif"), n=-1)
    height = frames.get("page-height")
    first, last = (frames.crop(0, p * height, frames.width, height).flatten() for p in (0, 9))
    assert mad(still, first) < 0.5 < 3 < mad(still, last)  # measured 0.0 and 5.7
    webp = decode(pick(rendered("animated-loop-3.gif"), "thumb", "webp").data, n=-1)
    assert not webp.get_typeof("n-pages") or webp.get("n-pages") == 1


@pytest.mark.parametrize(
    "data",
    [
        random.Random(0).randbytes(4096),
        b"This is a text file, not a photo.\n" * 20,
        b"id,name,width\n1,beach,1800\n2,city,1200\n",
        b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + bytes(64),  # an MP4
        b"",
    ],
    ids=["random", "text", "csv", "mp4", "empty"],
)
def test_non_images_are_unsupported(data: bytes) -> None:
    """Content that is not an allowed image format fails with code unsupported_format."""
    with pytest.raises(UnsupportedFormatError) as caught:
        render(data, DEFAULTS, MAX_PIXELS)
    assert caught.value.code == "unsupported_format"


def test_formats_outside_the_allow_list_are_unsupported() -> None:
    """A valid image in a format libvips could read but darkroom does not allow is refused."""
    with pytest.raises(UnsupportedFormatError):
        render(bytes(pyvips.Image.black(8, 8).tiffsave_buffer()), DEFAULTS, MAX_PIXELS)


@pytest.mark.parametrize(
    ("name", "keep"),
    [("Landscape_1.jpg", 0.5), ("png-alpha-64bit.png", 0.5), ("4.webp", 0.5),
     ("avif-orientation-6.avif", 0.5), ("iphone_13_pro_max.HEIC", 0.001)],
)  # fmt: skip
def test_truncated_photos_are_corrupt(name: str, keep: float) -> None:
    """A photo cut short fails with code corrupt_image instead of rendering garbage."""
    data = photo(name)
    with pytest.raises(CorruptImageError) as caught:
        render(data[: int(len(data) * keep)], DEFAULTS, MAX_PIXELS)
    assert caught.value.code == "corrupt_image"


def test_heic_cut_in_its_pixel_data_is_corrupt() -> None:
    """A HEIC whose pixel data (mdat) is cut short fails with corrupt_image, not a green patch."""
    data = photo("iphone_13_pro_max.HEIC")
    with pytest.raises(CorruptImageError):
        render(data[: len(data) // 2], DEFAULTS, MAX_PIXELS)


def test_pixel_budget_is_checked_from_the_header() -> None:
    """A small file that claims 20000x20000 pixels is refused as image_too_large."""
    bomb = bytes(pyvips.Image.black(20000, 20000).pngsave_buffer(compression=9))
    assert len(bomb) < 2_000_000
    assert MAX_PIXELS < 20000 * 20000
    with pytest.raises(ImageTooLargeError) as caught:
        render(bomb, DEFAULTS, MAX_PIXELS)
    assert caught.value.code == "image_too_large"


GAIN_MAP_PIXELS = {"iphone_13_pro_max.HEIC": 1512 * 2016}  # Apple's HDR map counts too


@pytest.mark.parametrize("name", ["Landscape_1.jpg", "iphone_13_pro_max.HEIC", "4.webp"])
def test_pixel_budget_is_inclusive(name: str) -> None:
    """A photo of exactly max_pixels (its gain map's included) renders; one less refuses it."""
    _, width, height = FACTS[name]
    budget = width * height + GAIN_MAP_PIXELS.get(name, 0)
    assert render(photo(name), parse_renditions("t:64:png"), budget).facts.width == width
    with pytest.raises(ImageTooLargeError):
        render(photo(name), DEFAULTS, budget - 1)


def test_custom_renditions_are_honoured_without_upscaling() -> None:
    """Sizes and formats from parse_renditions are used; 4000 px on a 1800 px photo stays 1800."""
    specs = parse_renditions("tiny:64:png,big:4000:avif:50")
    result = render(photo("Landscape_1.jpg"), specs, MAX_PIXELS)
    for spec in specs:
        out = pick(result, spec.name, spec.format)
        assert out.ext == spec.ext
        assert_rendition(out, spec.size, (1800, 1200))
    assert (pick(result, "big", "avif").width, pick(result, "tiny", "png").width) == (1800, 64)


def test_a_photo_smaller_than_several_boxes_is_encoded_once_per_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 64×48 sticker fits every box: thumb, medium and large WebP are the same pixels at
    the same quality, so one encode gives all three (identical bytes); the JPEG is its own."""
    from darkroom.image import pipeline

    saves: list[str] = []
    real_save = pipeline._save
    monkeypatch.setattr(pipeline, "_save", lambda image, spec: saves.append(spec.format)
                        or real_save(image, spec))  # fmt: skip
    small = pyvips.Image.black(64, 48, bands=3).draw_rect([200, 40, 10], 8, 8, 20, 20, fill=True)
    result = render(small.pngsave_buffer(), DEFAULTS, MAX_PIXELS)
    webps = [r for r in result.renditions if r.format == "webp"]
    assert [r.name for r in webps] == ["large", "medium", "thumb"]
    assert {(r.width, r.height) for r in webps} == {(64, 48)}
    assert len({r.data for r in webps}) == 1 and len({r.sha256 for r in webps}) == 1
    assert sorted(saves) == ["jpeg", "webp"]
    # a photo between the boxes: large and medium WebP share an encode, thumb is shrunk
    saves.clear()
    mid = render(pyvips.Image.black(800, 600, bands=3).pngsave_buffer(), DEFAULTS, MAX_PIXELS)
    assert sorted(saves) == ["jpeg", "webp", "webp"]
    assert pick(mid, "thumb", "webp").width == 320
    assert pick(mid, "large", "webp").data == pick(mid, "medium", "webp").data
