"""Quality targets per rendition: q=auto and score=N choose the quality per photo."""

from __future__ import annotations

import io
import uuid

import pytest
import pyvips

from darkroom import uploads
from darkroom.image import quality
from darkroom.image.pipeline import render
from darkroom.image.renderer import RenderPool
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions
from tests.conftest import PHOTOS

MAX_PIXELS = 100_000_000


def _png(image: pyvips.Image) -> bytes:
    return bytes(image.pngsave_buffer(compression=1))


def _easy() -> bytes:
    """A clear sky: a smooth vertical gradient, nothing for an encoder to keep."""
    ramp = pyvips.Image.xyz(800, 600)[1] * (120 / 600) + 80
    return _png(ramp.bandjoin([ramp + 30, ramp + 90]).cast("uchar"))


def _hard() -> bytes:
    """Foliage-like: fine noise a pixel or two wide, every patch its own detail."""
    noise = pyvips.Image.gaussnoise(800, 600, sigma=20, mean=128).gaussblur(0.7)
    return _png(noise.bandjoin([noise.rot180(), noise.fliphor()]).cast("uchar"))


@pytest.mark.parametrize("fmt", ["webp", "jpeg"])
def test_an_easy_photo_gets_a_lower_quality_than_a_hard_one(fmt: str) -> None:
    """Under q=auto a flat sky is encoded at a lower quality than noise, and is smaller."""
    specs = parse_renditions(f"m:800:{fmt}:q=auto")
    easy = render(_easy(), specs, MAX_PIXELS).renditions[0]
    hard = render(_hard(), specs, MAX_PIXELS).renditions[0]
    assert easy.quality < hard.quality
    assert easy.score is not None and hard.score is not None


@pytest.mark.parametrize("target", [60, 80])
def test_a_score_target_is_met_within_tolerance(target: int) -> None:
    """score=N on a real photo: the rendition scores N or more, within the metric's error."""
    data = (PHOTOS / "Landscape_1.jpg").read_bytes()
    out = render(data, parse_renditions(f"m:512:webp:score={target},r:512:png"), MAX_PIXELS)
    encoded, reference = out.renditions
    try:  # the reference metric when the bench group is installed
        from ssimulacra2 import compute_ssimulacra2

        measured = float(compute_ssimulacra2(io.BytesIO(reference.data), io.BytesIO(encoded.data)))
        tolerance = 8.0  # the calibrated metric's worst error over the corpus (docs/photos.md)
    except ImportError:  # else the calibrated metric on the whole rendition, not its sample
        pixels = quality.luma(pyvips.Image.new_from_buffer(reference.data, ""))
        decoded = quality.luma(pyvips.Image.new_from_buffer(encoded.data, ""))
        measured, tolerance = quality.similarity("webp", pixels, decoded), 3.0
    assert measured >= target - tolerance
    assert encoded.quality < quality.RANGE["webp"][1] or target > 75


def test_a_higher_target_never_chooses_a_lower_quality() -> None:
    """score=80 is encoded at least as high as score=60 on the same photo, and is larger."""
    data = (PHOTOS / "Landscape_2.jpg").read_bytes()
    low, high = render(
        data, parse_renditions("a:512:jpeg:score=60,b:512:jpeg:score=80"), MAX_PIXELS
    ).renditions
    assert low.quality <= high.quality and len(low.data) <= len(high.data)


@pytest.mark.parametrize("name", ["Landscape_1.jpg", "iphone_hdr_NO.jpg", "embedgravitybird.png"])
def test_q_auto_is_never_above_the_fixed_quality_nor_larger(name: str) -> None:
    """q=auto only ever lowers the quality from the fixed one: bytes never go up."""
    auto = parse_renditions("b:1024:webp:q=auto,j:1024:jpeg:q=auto")
    fixed = parse_renditions("b:1024:webp,j:1024:jpeg")
    data = (PHOTOS / name).read_bytes()
    pairs = zip(render(data, auto, MAX_PIXELS).renditions,
                render(data, fixed, MAX_PIXELS).renditions, strict=True)  # fmt: skip
    for a, f in pairs:
        assert a.quality <= f.quality and len(a.data) <= len(f.data)


def test_a_photo_at_or_below_the_floor_keeps_the_fixed_quality() -> None:
    """The relative rule: no drop allowed when the score at the fixed quality is not above
    the floor; a lower floor never chooses a higher quality."""
    image = pyvips.Image.new_from_buffer(_hard(), "")
    encode = lambda i, q: bytes(i.webpsave_buffer(Q=q))  # noqa: E731
    assert quality.relative(image, "webp", 80, 100.0, encode).quality == 80
    chosen = [quality.relative(image, "webp", 80, f, encode).quality for f in (0, 40, 60, 100)]
    assert chosen == sorted(chosen) and chosen[0] < 80


def test_q_auto_chooses_once_per_photo_and_format_and_keeps_thumbnails_fixed() -> None:
    """The drop chosen on a photo's largest WebP is reused by its other WebPs; a rendition
    under MIN_RELATIVE (a thumbnail the metric misjudges) keeps the fixed quality."""
    data = (PHOTOS / "Landscape_1.jpg").read_bytes()
    text = "l:1600:webp:q=auto,m:800:webp:q=auto,t:320:webp:q=auto"
    large, medium, thumb = render(data, parse_renditions(text), MAX_PIXELS).renditions
    assert large.quality == medium.quality < 80 and large.score == medium.score
    assert (thumb.quality, thumb.score) == (80, None)


# sha256 prefixes of the default list (plus a cropped box) as main rendered them before
# quality targets existed: a fixed quality must keep encoding exactly the same bytes.
BEFORE = {
    "Landscape_1.jpg": ["06df8e8cbf4b40ff", "7a5f2d425949398f", "6f6b41644019ee70",
                        "1cd26ff5277148b0", "42618f5d9a2827c3"],
    "embedgravitybird.png": ["4a027b6af66cedd5", "4a027b6af66cedd5", "3bc2270bcc3b92d8",
                             "2275994c83f97da2", "de3089ea5bd454ad"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_fixed_quality_lists_render_the_same_bytes_as_before(name: str) -> None:
    """The default list and a box at fixed quality encode byte for byte as they did."""
    specs = parse_renditions(DEFAULT_RENDITIONS + ",a:64x64:jpeg:crop=attention")
    out = render((PHOTOS / name).read_bytes(), specs, MAX_PIXELS).renditions
    assert [r.sha256[:16] for r in out] == BEFORE[name]
    assert all(r.score is None and r.quality == s.quality for r, s in zip(out, specs, strict=True))


def test_the_manifest_records_the_chosen_quality_and_score_of_a_target_only() -> None:
    """A q=auto rendition's row entry names its quality and score; a fixed one is as before."""
    data = (PHOTOS / "Landscape_1.jpg").read_bytes()
    auto, fixed = render(
        data, parse_renditions("a:640:webp:q=auto,f:640:jpeg"), MAX_PIXELS
    ).renditions
    key = f"renditions/{uuid.uuid4()}/a.webp"
    described = uploads.described(auto, key)
    assert described["quality"] == auto.quality and described["score"] == auto.score
    assert described["scored_by"] == "ssim-calibrated"
    plain = {"name", "format", "type", "key", "width", "height", "bytes"}
    assert set(uploads.described(fixed, key)) == plain


async def test_a_render_process_returns_the_quality_it_chose() -> None:
    """Through the worker's render pool, a q=auto rendition comes back as encoded in-process."""
    data = (PHOTOS / "Landscape_6.jpg").read_bytes()
    specs = parse_renditions("m:512:webp:q=auto,f:512:jpeg")
    settings = Settings()
    async with RenderPool(1, max_pixels=settings.max_pixels, timeout_s=120.0, memory_mb=2048,
                          renders_per_process=100, max_rss_mb=512,
                          keep_mb=settings.render_keep_mb) as renderer:  # fmt: skip
        pooled = (await renderer.render(data, specs)).renditions
    local = render(data, specs, settings.max_pixels).renditions
    assert [(r.quality, r.score, r.sha256) for r in pooled] == [
        (r.quality, r.score, r.sha256) for r in local
    ]
    assert pooled[0].score is not None and pooled[1].score is None


@pytest.mark.parametrize("size", [(2, 1000), (6, 6)], ids=["strip", "icon"])
def test_an_image_too_small_to_score_gets_the_fixed_quality(size: tuple[int, int]) -> None:
    """A 2×1000 strip or a 6×6 icon with q=auto is encoded at the format's quality with no
    score: neither an empty sample tile (a valid photo failed as corrupt) nor a NaN score."""
    [spec] = parse_renditions("t:2048:webp:q=auto")
    image = pyvips.Image.black(*size, bands=3).copy(interpretation="srgb")
    data, chosen, score = quality.encoded(image, spec, lambda i, s: i.webpsave_buffer(Q=s.quality))
    assert data and (chosen, score) == (spec.quality, None)
