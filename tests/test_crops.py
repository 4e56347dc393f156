"""Box renditions and the focal point: a cropped box keeps the photo's subject and has
exactly the box's size, the focal point lands on the subject, a fitted box fits, and the
long-edge renditions of a list are the same bytes whatever boxes it also names."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import pyvips

from darkroom.errors import CorruptImageError
from darkroom.image import isobmff, pipeline
from darkroom.settings import DEFAULT_RENDITIONS, parse_renditions
from tests.conftest import PHOTOS, Env
from tests.hdrcraft import correlation, map_of, ultra_hdr

BUDGET = 10**8
BACKGROUNDS = [(40, 70, 110), (30, 30, 30), (90, 120, 60), (120, 90, 70)]
# (width, height, subject centre x, y in 0..1): wide and tall photos, the subject off-centre
SUBJECTS = [
    (960, 480, 0.2, 0.5), (960, 480, 0.8, 0.4), (960, 480, 0.15, 0.3), (960, 480, 0.85, 0.7),
    (480, 960, 0.5, 0.2), (480, 960, 0.4, 0.8), (480, 960, 0.6, 0.15), (480, 960, 0.5, 0.85),
    (1280, 720, 0.15, 0.6), (1280, 720, 0.85, 0.35), (720, 1280, 0.35, 0.15),
    (720, 1280, 0.6, 0.85),
]  # fmt: skip
SQUARES = parse_renditions("sq:128x128:png:crop=attention,mid:128x128:png:crop=centre")


class Subject:
    """A flat background with a bright, textured square (a quarter of the short side)."""

    def __init__(self, index: int) -> None:
        width, height, cx, cy = SUBJECTS[index]
        self.size, self.background = (width, height), BACKGROUNDS[index % 4]
        self.side = min(width, height) // 4
        self.left, self.top = int(cx * width - self.side / 2), int(cy * height - self.side / 2)
        pixels = np.empty((height, width, 3), np.uint8)
        pixels[:] = self.background
        texture = np.random.default_rng(index).integers(150, 256, (self.side, self.side, 3))
        pixels[self.top : self.top + self.side, self.left : self.left + self.side] = texture
        image = pyvips.Image.new_from_memory(pixels.tobytes(), width, height, 3, "uchar")
        self.png = bytes(image.pngsave_buffer())

    def shown(self, rendition: pipeline.Rendered) -> float:
        """The share of the subject's pixels (at the rendition's scale) it shows."""
        image = pyvips.Image.new_from_buffer(rendition.data, "")
        pixels = np.frombuffer(image.write_to_memory(), np.uint8)
        pixels = pixels.reshape(image.height, image.width, image.bands)[:, :, :3].astype(int)
        subject = np.abs(pixels - np.array(self.background)).sum(axis=2) > 60
        scale = max(image.width / self.size[0], image.height / self.size[1])
        return float(subject.sum() / (self.side * scale) ** 2)


@cache
def rendered(index: int) -> pipeline.RenderResult:
    return pipeline.render(Subject(index).png, SQUARES, BUDGET)


@pytest.mark.parametrize("index", range(len(SUBJECTS)))
def test_attention_square_keeps_the_subject(index: int) -> None:
    """crop=attention shows the whole off-centre subject, where a centre crop misses most."""
    attention, centre = rendered(index).renditions
    assert (attention.width, attention.height) == (centre.width, centre.height) == (128, 128)
    assert Subject(index).shown(attention) > 0.9
    assert Subject(index).shown(centre) < 0.6


@pytest.mark.parametrize("index", range(len(SUBJECTS)))
def test_focal_point_lands_on_the_subject(index: int) -> None:
    """The stored focal point (0..1 of the photo) falls inside the subject."""
    facts, subject = rendered(index).facts, Subject(index)
    assert facts.focal_x is not None and facts.focal_y is not None
    x, y = facts.focal_x * subject.size[0], facts.focal_y * subject.size[1]
    assert subject.left <= x <= subject.left + subject.side
    assert subject.top <= y <= subject.top + subject.side


def test_cropped_box_has_the_subject_in_view_on_every_side() -> None:
    """A wide and a tall box follow the subject too, at exactly their sizes."""
    boxes = parse_renditions(
        "wide:200x100:webp:crop=attention,tall:60x180:jpeg:q=90:crop=attention"
    )
    for index in (0, 5, 9):
        result = pipeline.render(Subject(index).png, boxes, BUDGET)
        assert [(r.width, r.height, r.crop) for r in result.renditions] == [
            (200, 100, "attention"), (60, 180, "attention")]  # fmt: skip
        assert Subject(index).shown(result.renditions[0]) > 0.85


def test_fitted_box_fits_inside_and_keeps_the_shape() -> None:
    """A box without crop fits the whole photo inside it; a centre crop fills it exactly."""
    specs = parse_renditions("fit:200x200:png,strip:300x50:png,centre:150x150:webp:crop=centre")
    result = pipeline.render(Subject(0).png, specs, BUDGET)  # 960×480
    sizes = {r.name: (r.width, r.height, r.crop) for r in result.renditions}
    assert sizes == {"fit": (200, 100, None), "strip": (100, 50, None),
                     "centre": (150, 150, "centre")}  # fmt: skip


def test_photo_smaller_than_a_cropped_box_is_not_enlarged() -> None:
    """A photo smaller than its box gives the box's shape at the photo's own size."""
    small = bytes(pyvips.Image.black(120, 90, bands=3).pngsave_buffer())
    specs = parse_renditions("avatar:256x256:png:crop=attention,banner:400x100:png:crop=centre")
    result = pipeline.render(small, specs, BUDGET)
    sizes = {r.name: (r.width, r.height) for r in result.renditions}
    assert sizes == {"avatar": (90, 90), "banner": (120, 30)}


def test_decode_keeps_enough_for_a_cropped_box() -> None:
    """The only rendition a square crop of a 2:1 photo: its short side still reaches the box."""
    result = pipeline.render(Subject(0).png, parse_renditions("sq:400x400:png:crop=centre"), BUDGET)
    assert (result.renditions[0].width, result.renditions[0].height) == (400, 400)


@pytest.mark.parametrize("name", ["Landscape_6.jpg", "iphone_13_pro_max.HEIC", "4.webp"])
def test_boxes_leave_the_long_edge_renditions_alone(name: str) -> None:
    """Today's list renders the same bytes with boxes added beside it."""
    data = (PHOTOS / name).read_bytes()
    plain = pipeline.render(data, parse_renditions(DEFAULT_RENDITIONS), BUDGET)
    extra = f"{DEFAULT_RENDITIONS},sq:256x256:webp:crop=attention,fit:640x200:jpeg"
    both = pipeline.render(data, parse_renditions(extra), BUDGET)
    assert [r.sha256 for r in both.renditions[:4]] == [r.sha256 for r in plain.renditions]
    assert both.facts == plain.facts


def test_worker_stores_crops_and_the_focal_point(file_env: Env, tmp_path: Path) -> None:
    """Through a worker: the row's renditions name their crop; the focal point is stored."""
    path = tmp_path / "subject.png"
    path.write_bytes(Subject(1).png)
    (photo,) = file_env.ingest([path])
    file_env.cli(
        "run", "--drain", DARKROOM_RENDITIONS="thumb:320:webp,sq:64x64:webp:crop=attention"
    )
    (row,) = file_env.query("SELECT renditions, focal_x, focal_y FROM photos WHERE id = $1", photo)
    entries = {r["name"]: r for r in json.loads(row["renditions"])}
    assert (entries["sq"]["width"], entries["sq"]["height"], entries["sq"]["crop"]) == (
        64,
        64,
        "attention",
    )
    assert "crop" not in entries["thumb"]
    subject = Subject(1)
    assert subject.left <= row["focal_x"] * 960 <= subject.left + subject.side


def test_cropped_jpeg_box_carries_its_gain_map_cropped_alike() -> None:
    """An HDR JPEG's centre square keeps the gain map of the same region, not of the left."""
    data = ultra_hdr((PHOTOS / "Landscape_1.jpg").read_bytes())  # 1800×1200, a 1/4 map
    specs = parse_renditions("big:600:jpeg,sq:200x200:jpeg:crop=centre")
    big, square = pipeline.render(data, specs, BUDGET).renditions
    assert (square.width, square.height) == (200, 200)
    whole = map_of(big.data).resize(0.5).extract_band(0)  # the 300×200 the square is cut from
    region = map_of(square.data).extract_band(0)
    assert (region.width, region.height) == (50, 50)
    assert correlation(whole.crop(12, 0, 50, 50), region) > 0.9
    assert correlation(whole.crop(0, 0, 50, 50), region) < 0.7


class _Props:
    """A container whose primary item carries the given properties."""

    def __init__(self, *props: tuple[bytes, bytes]) -> None:
        self.props_ = [(kind, payload, False) for kind, payload in props]

    def props(self, item: int) -> list[tuple[bytes, bytes, bool]]:
        return self.props_


@pytest.mark.parametrize(
    "props", [(b"clap", bytes(10)), (b"irot", b""), (b"imir", b"")], ids=["clap", "irot", "imir"]
)
def test_a_truncated_transform_property_is_a_corrupt_image(props: tuple[bytes, bytes]) -> None:
    """A clap shorter than its 32 bytes, or an empty irot or imir, is `corrupt_image`, not
    an exception that would kill the render process (and read as a crash, retried)."""
    with pytest.raises(CorruptImageError, match="truncated"):
        isobmff.transform_steps(_Props(props), 1, 64, 48)  # type: ignore[arg-type]
