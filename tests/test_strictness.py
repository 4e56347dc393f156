"""One standard of strictness for every decoder: structurally invalid data fails
as corrupt_image in every allowed format, and valid but less common HEIF/AVIF structures
(large grids past libheif's default limits) render."""

from __future__ import annotations

from pathlib import Path

import pytest
import pyvips

from darkroom.errors import CorruptImageError
from darkroom.image import gif, isobmff, pipeline
from darkroom.image.selfcheck import sample
from darkroom.settings import parse_renditions
from tests.conftest import PHOTOS, Env
from tests.heifcraft import (
    Tile,
    a1op,
    clap,
    grid,
    grid_twice,
    imir,
    irot,
    layered,
    overlay_twice,
    transformed,
)

SPECS = parse_renditions("thumb:320:webp:80,large:2048:jpeg:80")


def short_gif_frame(gif: bytes, keep_blocks: int) -> bytes:
    """The GIF with its first frame's LZW data cut after `keep_blocks` sub-blocks, then
    properly terminated: a frame short of its pixel data in an otherwise valid file."""
    pos = 13
    if gif[10] & 0x80:
        pos += 3 * 2 ** ((gif[10] & 7) + 1)
    while gif[pos] == 0x21:  # extensions
        pos += 2
        while gif[pos]:
            pos += gif[pos] + 1
        pos += 1
    assert gif[pos] == 0x2C
    local = gif[pos + 9]
    pos += 10 + (3 * 2 ** ((local & 7) + 1) if local & 0x80 else 0) + 1
    for _ in range(keep_blocks):
        pos += gif[pos] + 1
    return gif[:pos] + b"\x00\x3b"


def photo_gif() -> bytes:
    return bytes(pyvips.Image.thumbnail(str(PHOTOS / "Landscape_1.jpg"), 400).gifsave_buffer())


def test_gif_frame_short_of_its_pixels_is_corrupt() -> None:
    whole = photo_gif()
    assert pipeline.render(whole, SPECS, 10**8).facts.width == 400
    short = short_gif_frame(whole, 20)
    # libvips alone renders it, mostly transparent filler: the reason for the check
    assert pyvips.Image.new_from_buffer(short, "", fail_on="error").width == 400
    with pytest.raises(
        CorruptImageError, match=r"GIF frame data is incomplete: \d+ of 106800 pixels"
    ):
        pipeline.render(short, SPECS, 10**8)


@pytest.mark.parametrize("fmt", ["heic", "avif"])
@pytest.mark.parametrize(
    ("refs", "message"),
    [
        ([2, 3, 4, 99], "missing item 99"),
        ([2, 3, 4], "references 3 tiles"),
        ([2, 3, 4, 5, 2], "references 5 tiles"),
        ([1, 2, 3, 4], "references itself"),
    ],
)
def test_invalid_heif_item_references_are_corrupt(fmt: str, refs: list[int], message: str) -> None:
    data = grid(sample(f"sample.{fmt}"), 2, 2, refs)
    with pytest.raises(CorruptImageError, match=message):
        pipeline.render(data, SPECS, 10**8)


@pytest.mark.parametrize("fmt", ["heic", "avif"])
def test_grid_past_libheif_default_limits_renders(fmt: str) -> None:
    """17×16 tiles: 273 items, over libheif's default of 256, valid per the spec."""
    data = grid(sample(f"sample.{fmt}"), 17, 16)
    if fmt == "avif":
        with pytest.raises(pyvips.Error, match="security limit"):
            pyvips.Image.new_from_buffer(data, "")  # libheif's defaults refuse it
    result = pipeline.render(data, SPECS, 10**8)
    tile_w, tile_h = (64, 64) if fmt == "heic" else (24, 32)
    assert (result.facts.width, result.facts.height) == (17 * tile_w, 16 * tile_h)


def test_grid_pixel_budget_still_applies() -> None:
    from darkroom.errors import ImageTooLargeError

    data = grid(sample("sample.avif"), 17, 16)
    with pytest.raises(ImageTooLargeError):
        pipeline.render(data, SPECS, 100_000)


@pytest.mark.parametrize("fmt", ["heic", "avif"])
def test_derived_image_cycle_is_corrupt(fmt: str) -> None:
    """A tile deriving from its own grid: refused before libheif follows it."""
    data = grid(sample(f"sample.{fmt}"), 1, 1, cycle=True)
    with pytest.raises(CorruptImageError, match="cycle"):
        pipeline.render(data, SPECS, 10**8)


@pytest.mark.parametrize("name", ["iphone_13_pro_max.HEIC", "avif-orientation-6.avif"])
def test_real_heif_files_pass_the_structure_check(name: str) -> None:
    isobmff.check((PHOTOS / name).read_bytes())


def test_corrupt_structures_fail_through_the_worker(file_env: Env, tmp_path: Path) -> None:
    """Through a worker: invalid structures fail as corrupt_image, valid classes are processed."""
    quadrants = Tile((Path(__file__).parent / "heif-samples" / "quadrants.heic").read_bytes())
    layers = (Path(__file__).parent / "heif-samples" / "quadrants-3layers.obu").read_bytes()
    bad = {
        "short-frame.gif": short_gif_frame(photo_gif(), 20),
        "missing-tile.heic": grid(sample("sample.heic"), 2, 2, [2, 3, 4]),
        "missing-item.avif": grid(sample("sample.avif"), 2, 2, [2, 3, 4, 99]),
        "non-essential-clap.avif": transformed(
            Tile(sample("sample.avif")), [(clap(20, 20), False)]
        ),
        "tile-twice.heic": grid_twice(Tile(sample("sample.heic"))),
    }
    good = {
        "big-grid.avif": (grid(sample("sample.avif"), 17, 16), (408, 512)),
        "cropped-turned.heic": (
            transformed(quadrants, [(clap(424, 246), True), (irot(1), True), (imir(0), True)]),
            (246, 424),
        ),
        "unmarked-crop-turn.heic": (
            transformed(quadrants, [(clap(424, 246), False), (irot(1), False)]),
            (246, 424),
        ),
        "overlay-twice.heic": (
            overlay_twice(quadrants, (5 * 1436, 0), (0, 0, 0, 65535)),
            (2872, 730),
        ),
        "layered-op2.avif": (layered(layers, (360, 182), [(a1op(2), True)]), (360, 182)),
    }
    paths = []
    for name, data in {**bad, **{name: data for name, (data, _) in good.items()}}.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    ids = file_env.ingest(paths)
    file_env.cli("run", "--drain")
    rows = file_env.query("SELECT id, processing_state, error_code, width, height FROM photos")
    states = {row["id"]: tuple(row.values())[1:] for row in rows}
    assert [states[i] for i in ids] == [("processing_failed", "corrupt_image", None, None)] * len(
        bad
    ) + [("processed", None, *size) for _, size in good.values()]


def _tiny_gif(code_stream: bytes) -> bytes:
    """A 2×2 GIF, 4-colour global table, LZW minimum code size 2, the given code bytes."""
    header = b"GIF89a" + bytes([2, 0, 2, 0, 0x81, 0, 0]) + bytes(12)
    image = b"\x2c" + bytes(4) + bytes([2, 0, 2, 0, 0]) + b"\x02"
    return header + image + bytes([len(code_stream)]) + code_stream + b"\x00\x3b"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_tiny_gif(bytes([4 | 7 << 3])), "code 7 is not defined"),  # clear, then an unknown code
        (_tiny_gif(bytes([(4 | 5 << 6) & 255, 5 >> 2])), "1 of 4 pixels"),  # one pixel, end
        (_tiny_gif(b"")[:-3], "ends inside its first frame"),
        (b"GIF89a" + bytes([2, 0, 2, 0, 0, 0, 0]) + b"\x3b", "no image"),
    ],
)
def test_gif_structure_errors(data: bytes, message: str) -> None:
    with pytest.raises(CorruptImageError, match=message):
        gif.check_first_frame(data)


def test_valid_gifs_pass_the_frame_check() -> None:
    for data in (sample("sample.gif"), (PHOTOS / "animated-loop-3.gif").read_bytes(), photo_gif()):
        gif.check_first_frame(data)


def test_alpha_planes_render() -> None:
    """HEIC and AVIF with an alpha item (an `auxl` reference) keep their transparency."""
    rgba = pyvips.Image.new_from_buffer(sample("alpha.png"), "")
    avif = bytes(rgba.heifsave_buffer(compression="av1", Q=80))
    heic = (Path(__file__).parent / "heif-samples" / "alpha.heic").read_bytes()
    for data in (avif, heic):
        result = pipeline.render(data, parse_renditions("t:64:png"), 10**8)
        assert result.facts.has_alpha
        out = pyvips.Image.new_from_buffer(result.renditions[0].data, "")
        assert out.bands == 4 and out(18, 24)[3] == 0 and out(6, 8)[3] == 255


@pytest.mark.parametrize("fmt", ["heic", "avif"])
def test_overlays_and_clean_aperture_crops_render(fmt: str) -> None:
    tile_w, tile_h = (64, 64) if fmt == "heic" else (24, 32)
    specs = parse_renditions("t:4000:png")
    overlay = pipeline.render(grid(sample(f"sample.{fmt}"), 2, 1, overlay=True), specs, 10**8)
    assert (overlay.facts.width, overlay.facts.height) == (3 * tile_w, tile_h)
    canvas = pyvips.Image.new_from_buffer(overlay.renditions[0].data, "")
    assert canvas(canvas.width - 2, 2)[:3] == [255, 0, 0]  # the overlay's fill colour
    cropped = pipeline.render(grid(sample(f"sample.{fmt}"), 2, 2, crop=4), specs, 10**8)
    assert (cropped.facts.width, cropped.facts.height) == (2 * tile_w - 8, 2 * tile_h - 8)
