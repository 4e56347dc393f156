"""HDR originals: gain-map JPEGs give JPEG renditions with their gain map, every
other format the SDR base; the `hdr` fact; hostile gain maps fall back or fail alone."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import pyvips

from darkroom.errors import ImageTooLargeError
from darkroom.image import applehdr, gainmap, isobmff
from darkroom.image.pipeline import render
from darkroom.image.results import RenderResult
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions
from tests import hdrcraft
from tests.conftest import PHOTOS, Env
from tests.heifcraft import Item, Tile, box, coded, heif
from tests.imagecheck import jpeg_markers, mean_abs_diff, metadata_leaks

SPECS = parse_renditions(DEFAULT_RENDITIONS + ",small:320:jpeg:82")
MAX_PIXELS = Settings().max_pixels
# (photo, map scale): a phone's quarter-size map, a Lightroom-style full-size one, a photo
# with an Adobe RGB profile, one with GPS in its EXIF, one turned by EXIF orientation 6
SET = [("Landscape_1.jpg", 4), ("Landscape_2.jpg", 1), ("jpg-24bit-icc-adobe-rgb.jpg", 2),
       ("iphone_hdr_NO.jpg", 4), ("Landscape_6.jpg", 4)]  # fmt: skip


@cache
def original(name: str, scale: int) -> bytes:
    return hdrcraft.ultra_hdr((PHOTOS / name).read_bytes(), scale=scale)


@cache
def rendered(name: str, scale: int) -> RenderResult:
    return render(original(name, scale), SPECS, MAX_PIXELS)


def boost(data: bytes) -> list[float]:
    return list(pyvips.Image.new_from_buffer(data, "").get("gainmap-max-content-boost"))


@pytest.mark.parametrize(("name", "scale"), SET)
def test_jpeg_renditions_carry_the_gain_map_at_their_aspect(name: str, scale: int) -> None:
    """Every JPEG rendition reads back as Ultra HDR: a map of its aspect ratio (±1 px) and
    the original's content boost; the fact says `gainmap`."""
    result = rendered(name, scale)
    assert result.facts.hdr == "gainmap"
    for out in (r for r in result.renditions if r.format == "jpeg"):
        assert hdrcraft.loader(out.data) == "uhdrload_buffer", out.name
        assert boost(out.data) == pytest.approx(boost(original(name, scale)))
        gain = hdrcraft.map_of(out.data)
        assert abs(gain.height - gain.width * out.height / out.width) <= 1, (out.name, gain)
        assert gain.width <= out.width


@pytest.mark.parametrize(("name", "scale"), SET[:2])
def test_other_formats_keep_the_sdr_base_alone(name: str, scale: int) -> None:
    """WebP (no gain map in the format) and AVIF renditions carry no map."""
    result = render(original(name, scale), parse_renditions("w:512:webp,a:512:avif:50"), 10**9)
    for out in result.renditions:
        assert not gainmap.fields(pyvips.Image.new_from_buffer(out.data, "")), out.format


def test_sdr_base_looks_as_todays() -> None:
    """The rendition's base is today's rendition of the same JPEG read without its map."""
    uhdr = original("Landscape_1.jpg", 4)
    plain = render(uhdr[: hdrcraft.secondary_at(uhdr)], SPECS, MAX_PIXELS)
    assert plain.facts.hdr is None
    ours_all = rendered("Landscape_1.jpg", 4).renditions
    for ours, todays in zip(ours_all, plain.renditions, strict=True):
        assert mean_abs_diff(ours.data, todays.data) < 1.0, ours.name


def test_map_of_a_turned_original_turns_with_its_base() -> None:
    """EXIF orientation 6: the rendition's map is upright like its base (it follows the
    base's brightness), not a stretched copy of the stored one."""
    uhdr = hdrcraft.ultra_hdr((PHOTOS / "Landscape_6.jpg").read_bytes(), turn=False)
    [out] = render(uhdr, parse_renditions("m:1024:jpeg:82"), MAX_PIXELS).renditions
    gain = hdrcraft.map_of(out.data)
    luma = pyvips.Image.new_from_buffer(out.data, "").colourspace("b-w")[0]
    luma = luma.resize(gain.width / out.width, vscale=gain.height / out.height)
    width, height = min(luma.width, gain.width), min(luma.height, gain.height)
    luma, gain = luma.crop(0, 0, width, height), gain.crop(0, 0, width, height)
    assert hdrcraft.correlation(gain, luma) > 0.7  # measured 0.89; turned wrongly: < 0.2
    assert hdrcraft.correlation(gain.flipver(), luma) < 0.5


def test_no_location_or_camera_leaks_through_the_gain_map_container() -> None:
    """The original's GPS and camera are in neither the base nor the map: no XMP at all, and
    the EXIF libvips writes for uhdrsave holds no capture fact."""
    assert b"GPS" in original("iphone_hdr_NO.jpg", 4)
    for out in (r for r in rendered("iphone_hdr_NO.jpg", 4).renditions if r.format == "jpeg"):
        assert hdrcraft.loader(out.data) == "uhdrload_buffer"
        assert metadata_leaks(out.data) == [], out.name
        assert b"Apple" not in out.data and b"iPhone" not in out.data
        base = out.data[: hdrcraft.secondary_at(out.data)]
        assert 0xE1 not in jpeg_markers(base) and b"ICC_PROFILE" not in base  # cut by us
        assert mpf_first_size(base) == len(base)  # the index still tells the truth


def mpf_first_size(base: bytes) -> int:
    """The size the MPF index (big-endian, as libultrahdr writes it) gives the base image."""
    tiff = base.index(b"MPF\0") + 4
    (ifd,) = struct.unpack(">I", base[tiff + 4 : tiff + 8])
    (count,) = struct.unpack(">H", base[tiff + ifd : tiff + ifd + 2])
    for at in range(tiff + ifd + 2, tiff + ifd + 2 + 12 * count, 12):
        tag, _, _, entries = struct.unpack(">HHII", base[at : at + 12])
        if tag == 0xB002:
            return int(struct.unpack(">I", base[tiff + entries + 4 : tiff + entries + 8])[0])
    raise AssertionError("no MP entry")


def test_jpeg_without_gain_map_has_no_hdr_fact() -> None:
    """A plain JPEG renders as before: no map, `hdr` null."""
    result = render((PHOTOS / "Landscape_1.jpg").read_bytes(), SPECS, MAX_PIXELS)
    assert result.facts.hdr is None
    assert all(hdrcraft.loader(r.data) != "uhdrload_buffer" for r in result.renditions)


def _assert_sdr_fallback(data: bytes) -> None:
    result = render(data, SPECS, MAX_PIXELS)
    assert result.facts.hdr is None
    assert all(hdrcraft.loader(r.data) != "uhdrload_buffer" for r in result.renditions)


@pytest.mark.parametrize(
    "values",
    [{"max_content_boost": [1e30] * 3}, {"hdr_capacity_max": 1e9},
     {"gamma": [100.0] * 3}],
    ids=["absurd-boost", "absurd-headroom", "absurd-gamma"],
)  # fmt: skip
def test_absurd_gain_map_values_fall_back_to_the_sdr_base(values: dict[str, object]) -> None:
    """A map whose values no photo has is dropped: SDR renditions, no fact, no failure."""
    _assert_sdr_fallback(hdrcraft.resaved(original("Landscape_1.jpg", 4), **values))


def test_gain_map_of_the_wrong_shape_falls_back_to_the_sdr_base() -> None:
    """A map that does not cover its base (another aspect ratio) is dropped."""
    wrong = pyvips.Image.black(37, 400).cast("uchar")
    _assert_sdr_fallback(hdrcraft.resaved(original("Landscape_1.jpg", 4), gainmap=wrong))


def test_truncated_gain_map_falls_back_to_the_sdr_base() -> None:
    """A file cut inside its gain map renders its complete base as SDR."""
    uhdr = original("Landscape_1.jpg", 4)
    start = hdrcraft.secondary_at(uhdr)
    _assert_sdr_fallback(uhdr[: start + (len(uhdr) - start) // 2])


def test_unknown_gain_map_version_is_ignored() -> None:
    """An ISO 21496-1 map whose minimum version is not 0 is ignored, as the spec requires."""
    uhdr = original("Landscape_1.jpg", 4)
    at = uhdr.index(b"urn:iso:std:iso:ts:21496:-1\0", hdrcraft.secondary_at(uhdr)) + 28
    _assert_sdr_fallback(uhdr[:at] + b"\x00\x05" + uhdr[at + 2 :])


def test_pixel_budget_counts_the_gain_map() -> None:
    """A budget the base fits but base plus map does not refuses the photo."""
    uhdr = original("Landscape_2.jpg", 1)  # 1800×1200 with a full-size map
    render(uhdr, SPECS, 1800 * 1200 * 2)
    with pytest.raises(ImageTooLargeError, match="gain map"):
        render(uhdr, SPECS, 1800 * 1200 + 1000)


GOOD = [4.0] * 3 + [1.0] * 3 + [1.0] * 3 + [0.015625] * 6 + [1.0, 4.0]


@pytest.mark.parametrize(
    ("at", "value", "ok"),
    [(0, 4.0, True), (0, 0.5, False), (0, float("nan"), False), (6, -1.0, False),
     (9, 2.0, False), (16, 0.5, False), (16, 2.0**17, False)],
    ids=["valid", "max-under-min", "nan", "negative-gamma", "big-offset", "headroom-under-1",
         "headroom-over-16-stops"],
)  # fmt: skip
def test_plausible_values_are_a_photos(at: int, value: float, ok: bool) -> None:
    """ISO 21496-1 values beyond any photo's make the map unusable; a real set passes."""
    assert gainmap.plausible([*GOOD[:at], value, *GOOD[at + 1 :]]) is ok


@pytest.mark.parametrize(
    ("size", "ok"),
    [((450, 300), True), ((1800, 1200), True), ((451, 300), True), ((450, 302), False),
     ((100, 67), False), ((1801, 1200), False), ((0, 0), False)],
)  # fmt: skip
def test_map_fits_its_base_only_at_its_aspect(size: tuple[int, int], ok: bool) -> None:
    """A map covers an 1800×1200 base at one aspect ratio (±1 px), 1 to 16 times smaller."""
    assert gainmap.fits(1800, 1200, *size) is ok


# --- HEIF and AVIF: the fact, the SDR base ------------------------------------------------


def test_apple_heic_gain_map_is_carried_into_jpeg_renditions() -> None:
    """An iPhone HEIC with Apple's HDR gain map: `gainmap`, JPEG renditions with an ISO map
    of their aspect and the headroom of Apple's formula (2^1.64 here), no leak; WebP: SDR."""
    heic = (PHOTOS / "iphone_13_pro_max.HEIC").read_bytes()
    result = render(heic, SPECS, MAX_PIXELS)
    assert result.facts.hdr == "gainmap"
    for out in result.renditions:
        if out.format != "jpeg":
            assert not gainmap.fields(pyvips.Image.new_from_buffer(out.data, ""))
            continue
        assert boost(out.data) == pytest.approx([2 ** (1.8 - 20 * 3376 / 420939)] * 3)
        gain = hdrcraft.map_of(out.data)
        assert abs(gain.height - gain.width * out.height / out.width) <= 1, (out.name, gain)
        assert metadata_leaks(out.data) == [], out.name


def test_map_steps_follow_the_base_at_the_maps_scale() -> None:
    """A half-size map is cropped at half the coordinates; a quarter turn swaps the axes."""
    steps = [isobmff.Step("crop", (100, 40, 2000, 1000)), isobmff.Step("rotate", (1,)),
             isobmff.Step("crop", (10, 20, 900, 1800))]  # fmt: skip
    assert applehdr.scaled_steps(steps, 0.5, 0.25) == [
        ("crop", (50, 10, 1000, 250)), ("rotate", (1,)), ("crop", (2, 10, 225, 900))]  # fmt: skip


def note(tags: dict[int, tuple[int, int]], kind: int = 10) -> bytes:
    """An Apple maker note with these signed-rational tags (values after the IFD)."""
    head, values = applehdr.MAKER_NOTE_MAGIC + b"\x00\x01MM", b""
    start = 16 + 12 * len(tags) + 4
    entries = struct.pack(">H", len(tags))
    for index, (tag, (num, den)) in enumerate(sorted(tags.items())):
        entries += struct.pack(">HHII", tag, kind, 1, start + 8 * index)
        values += struct.pack(">ii", num, den)
    return head + entries + b"\0\0\0\0" + values


@pytest.mark.parametrize(
    ("tags", "stops"),
    [({33: (1, 2), 48: (1, 200)}, 1.8 - 20 / 200), ({33: (1, 2), 48: (1, 2)}, 1.601 - 0.101 / 2),
     ({33: (3, 2), 48: (1, 200)}, 3.0 - 70 / 200), ({33: (3, 2), 48: (1, 2)}, 2.303 - 0.303 / 2),
     ({33: (3, 2), 48: (100, 1)}, None), ({33: (1, 2)}, None), ({33: (1, 0), 48: (1, 2)}, None)],
    ids=["dim-low", "dim-high", "bright-low", "bright-high", "no-headroom", "tag-missing",
         "zero-denominator"],
)  # fmt: skip
def test_apple_headroom_follows_apples_formula(
    tags: dict[int, tuple[int, int]], stops: float | None
) -> None:
    """Tags 33 and 48 of the maker note give 2^stops; damage or no headroom gives None."""
    expected = None if stops is None else pytest.approx(2**stops)
    assert applehdr.headroom(note(tags)) == expected
    assert applehdr.headroom(note(tags)[:20]) is None


@cache
def avif_tile() -> Tile:
    image = pyvips.Image.black(64, 48, bands=3) + 128
    return Tile(bytes(image.cast("uchar").heifsave_buffer(compression="av1", Q=50)))


def nclx(transfer: int, matrix: int = 1) -> bytes:
    return box(b"colr", b"nclx" + struct.pack(">HHHB", 1, transfer, matrix, 0x80))


@pytest.mark.parametrize(("transfer", "fact"), [(16, "pq"), (18, "hlg"), (13, None)])
def test_avif_transfer_gives_the_fact(transfer: int, fact: str | None) -> None:
    """An AVIF tagged PQ or HLG (no gain map) says so and still renders to SDR."""
    data = heif(b"avif", [coded(avif_tile(), 1, [(nclx(transfer), False)])], [])
    result = render(data, parse_renditions("w:64:webp"), MAX_PIXELS)
    assert result.facts.hdr == fact


def pq_signal(nits: float) -> float:
    m1, m2, c1, c2, c3 = 2610 / 16384, 2523 / 32, 3424 / 4096, 2413 / 128, 2392 / 128
    y = (nits / 10000) ** m1
    return float(((c1 + c2 * y) / (1 + c3 * y)) ** m2)


def hlg_signal(nits: float) -> float:
    scene = (nits / 1000) ** (1 / 1.2)  # a grey's display light is 1000 · scene^1.2
    if scene <= 1 / 12:
        return math.sqrt(3 * scene)
    return 0.17883277 * math.log(12 * scene - 0.28466892) + 0.55991073


@pytest.mark.parametrize(("transfer", "signal"), [(16, pq_signal), (18, hlg_signal)])
def test_pq_and_hlg_are_tone_mapped_not_clipped(
    transfer: int, signal: Callable[[float], float]
) -> None:
    """Grey patches of 0-3000 cd/m² come out in order, every one distinct; reference white
    (203 cd/m²) near SDR white; nothing above it clips to one value."""
    nits = [0, 50, 100, 203, 600, 1000] + ([3000] if transfer == 16 else [])
    patches = [pyvips.Image.black(64, 64, bands=3) + round(signal(n) * 255) for n in nits]
    lossless = (
        pyvips.Image.arrayjoin(patches)
        .cast("uchar")
        .heifsave_buffer(compression="av1", lossless=True)
    )  # lossless AV1 is coded as GBR: matrix 0
    data = heif(b"avif", [coded(Tile(bytes(lossless)), 1, [(nclx(transfer, 0), False)])], [])
    out = pyvips.Image.new_from_buffer(
        render(data, parse_renditions("p:512:png"), MAX_PIXELS).renditions[0].data, ""
    )
    greys = [out(32 + 64 * i, 32)[1] for i in range(len(nits))]
    assert greys == sorted(set(greys)), greys
    assert 225 <= greys[nits.index(203)] <= 250, greys


@pytest.mark.parametrize(("payload", "fact"), [(b"\x00\x00\x00\x00\x00" + b"\0" * 40, "gainmap"),
                                               (b"\x00\x00\x01\x00\x01" + b"\0" * 40, None),
                                               (b"\x01" + b"\0" * 44, None)])  # fmt: skip
def test_avif_tmap_of_a_known_version_gives_the_fact(payload: bytes, fact: str | None) -> None:
    """An AVIF `tmap` (ISO 21496-1) of version 0 says `gainmap`; unknown versions are ignored."""
    tile = avif_tile()
    data = heif(b"avif", [coded(tile, 1), Item(2, b"tmap", payload, hidden=True)],
                [(b"dimg", 2, [1])])  # fmt: skip
    assert gainmap.of_heif(data, isobmff.check(data)) == fact


def test_hdr_fact_reaches_the_photos_row(file_env: Env, tmp_path: Path) -> None:
    """Through the real worker: `photos.hdr` is `gainmap` for a gain-map JPEG, null for SDR."""
    path = tmp_path / "uhdr.jpg"
    path.write_bytes(original("Landscape_1.jpg", 4))
    ids = file_env.ingest([path, PHOTOS / "Landscape_2.jpg"])
    file_env.cli("run", "--drain")
    rows = {r["id"]: r for r in file_env.query("SELECT id, hdr, processing_state FROM photos")}
    assert [rows[i]["hdr"] for i in ids] == ["gainmap", None]
    assert {r["processing_state"] for r in rows.values()} == {"processed"}
