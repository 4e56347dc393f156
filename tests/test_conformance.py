"""Conformance of HEIF/AVIF handling: the classes of public conformance files
that failed, rebuilt with tests/heifcraft.py around real HEVC and AV1 payloads
(tests/heif-samples), render as ISO/IEC 23008-12 says, within DARKROOM_MAX_PIXELS, and the
two classes the specification forbids are refused as corrupt_image."""

from __future__ import annotations

import struct
from functools import cache
from pathlib import Path

import pi_heif
import pytest
import pyvips

from darkroom.errors import CorruptImageError, ImageTooLargeError
from darkroom.image import av1, heifedit, isobmff, pipeline
from darkroom.image.selfcheck import sample
from darkroom.settings import parse_renditions
from tests import heifcraft as hc

SAMPLES = Path(__file__).parent / "heif-samples"
FULL = parse_renditions("full:4000:png")  # never upscaled: the decode itself, losslessly
BUDGET = 10**8
RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)
QUADRANTS = ((RED, GREEN), (BLUE, WHITE))  # every sample's picture, split at its centre


@cache
def quadrants_hevc() -> hc.Tile:
    """1436×730 HEVC (x265) of the quadrant picture: the size of the conformance file."""
    return hc.Tile((SAMPLES / "quadrants.heic").read_bytes())


@cache
def layers_obu() -> bytes:
    """The same picture as three AV1 spatial layers: 360×182, 718×366, 1436×730."""
    return (SAMPLES / "quadrants-3layers.obu").read_bytes()


def rendered(data: bytes, budget: int = BUDGET) -> pyvips.Image:
    result = pipeline.render(data, FULL, budget)
    image = pyvips.Image.new_from_buffer(result.renditions[0].data, "")
    assert (image.width, image.height) == (result.facts.width, result.facts.height)
    return image


def colour_at(image: pyvips.Image, x: int, y: int) -> tuple[int, ...]:
    """The quadrant colour nearest the pixel (coded colours wander a little)."""
    pixel = image(x, y)[:3]
    return min(
        (c for row in QUADRANTS for c in row),
        key=lambda c: sum(abs(a - b) for a, b in zip(c, pixel, strict=True)),
    )


def source_point(
    ops: list[tuple[str, tuple[int, ...]]], size: tuple[int, int], u: int, v: int
) -> tuple[int, int]:
    """Where output pixel (u, v) comes from in the decoded picture, by the specification:
    a clap crops around the centre moved by its offsets, irot turns anti-clockwise in
    quarters, imir axis 0 exchanges top and bottom and axis 1 left and right. Sizes are
    carried forward, then the point is walked back through the operations."""
    sizes = [size]
    for op, args in ops:
        w, h = sizes[-1]
        sizes.append(
            args[:2] if op == "clap" else (h, w) if op == "irot" and args[0] % 2 else (w, h)
        )
    for (op, args), (w, h) in zip(reversed(ops), reversed(sizes[:-1]), strict=True):
        if op == "clap":
            u, v = u + (w - args[0]) // 2 + args[2], v + (h - args[1]) // 2 + args[3]
        elif op == "irot":  # a quarter turn of a w×h picture shows at (u, v) its (w - 1 - v, u)
            for turn in range(args[0], 0, -1):
                u, v = (w if turn % 2 else h) - 1 - v, u
        elif args[0] == 0:
            v = h - 1 - v
        else:
            u = w - 1 - u
    return u, v


def props(ops: list[tuple[str, tuple[int, ...]]]) -> list[tuple[bytes, bool]]:
    make = {
        "clap": lambda a: hc.clap(*a),
        "irot": lambda a: hc.irot(*a),
        "imir": lambda a: hc.imir(*a),
    }
    return [(make[op](args), True) for op, args in ops]


def assert_corners(
    image: pyvips.Image, ops: list[tuple[str, tuple[int, ...]]], size: tuple[int, int]
) -> None:
    """Each corner of the output shows the quadrant colour the specification puts there."""
    for u, v in (
        (3, 3),
        (image.width - 4, 3),
        (3, image.height - 4),
        (image.width - 4, image.height - 4),
    ):
        x, y = source_point(ops, size, u, v)
        assert 0 <= x < size[0] and 0 <= y < size[1]
        assert min(abs(x - size[0] // 2), abs(y - size[1] // 2)) > 8  # clear of the split
        expected = QUADRANTS[y >= size[1] // 2][x >= size[0] // 2]
        assert colour_at(image, u, v) == expected, (ops, (u, v), (x, y))


CROP = ("clap", (424, 246, -150, 60))  # 1436×730 → 424×246: libheif 1.23 allows 488×310 = 151280


@pytest.mark.parametrize("turn", [0, 1, 2, 3])
@pytest.mark.parametrize("mirror", [None, 0, 1])
def test_miaf_hevc_with_transformative_properties_renders_as_specified(
    turn: int, mirror: int | None
) -> None:
    """A 1436×730 HEVC cropped, turned and mirrored renders as the specification places it."""
    ops = [CROP, ("irot", (turn,))] + ([("imir", (mirror,))] if mirror is not None else [])
    image = rendered(hc.transformed(quadrants_hevc(), props(ops)))
    assert (image.width, image.height) == ((246, 424) if turn % 2 else (424, 246))
    assert_corners(image, ops, (1436, 730))


def test_libheif_alone_refuses_the_strong_crop() -> None:
    """The failure this fixes: libheif 1.23 bounds the decode by the cropped size."""
    data = hc.transformed(quadrants_hevc(), props([CROP]))
    pi_heif.options.DISABLE_SECURITY_LIMITS = True
    with pytest.raises(RuntimeError, match="exceeds the maximum image size 151280"):
        _ = pi_heif.open_heif(data).data


@pytest.mark.parametrize("turn", [0, 1, 2, 3])
@pytest.mark.parametrize("mirror", [None, 0, 1])
def test_own_transforms_give_libheifs_pixels(turn: int, mirror: int | None) -> None:
    """Where libheif can apply clap/irot/imir itself, darkroom's own show the same picture."""
    ops = [("clap", (1400, 700, 5, -3)), ("irot", (turn,))] + (
        [("imir", (mirror,))] if mirror is not None else []
    )
    data = hc.transformed(quadrants_hevc(), props(ops))
    pi_heif.options.DISABLE_SECURITY_LIMITS = True
    heif = pi_heif.open_heif(data)
    width, height = heif.size
    libheif = pyvips.Image.new_from_memory(bytes(heif.data), heif.stride // 3, height, 3, "uchar")
    libheif = libheif.crop(0, 0, width, height)
    ours = rendered(data)
    assert (ours.width, ours.height) == (width, height)
    # libheif crops before the chroma upsampling: colours differ on the quadrant edges only
    assert float((ours.cast("int") - libheif.cast("int")).abs().avg()) < 0.5


@pytest.mark.parametrize(
    ("clap", "expected"),
    [
        ((21, 1, 30, 1, 0, 1, 0, 1), (9, 0, 21, 30)),  # left 9.5: libheif rounds down
        ((20, 1, 29, 1, 0, 1, 0, 1), (10, 1, 20, 29)),  # top 0.5: libheif rounds to nearest
        ((41, 2, 30, 1, 1, 2, 0, 1), (10, 0, 21, 30)),  # width 20.5, centre moved 0.5 px
        ((20, 1, 10, 1, 3, 1, -4, 1), (13, 6, 20, 10)),
    ],
)
def test_clean_aperture_rounds_as_libheif(clap: tuple[int, ...], expected: tuple[int, ...]) -> None:
    """Fractional apertures crop the same pixels as libheif's own clap (through libvips)."""
    assert isobmff.clean_aperture(struct.pack(">IIIIiIiI", *clap), 40, 30) == expected
    ramp = pyvips.Image.xyz(40, 30)
    picture = (ramp[0] * 6).bandjoin([ramp[1] * 8, ramp[0] * 0]).cast("uchar")
    tile = hc.Tile(
        bytes(picture.copy(interpretation="srgb").heifsave_buffer(compression="av1", lossless=True))
    )
    clap_box = hc.box(b"clap", struct.pack(">IIIIiIiI", *clap))
    libheif = pyvips.Image.new_from_buffer(hc.transformed(tile, [(clap_box, True)]), "")
    left, top, width, height = expected
    assert (libheif.width, libheif.height) == (width, height)
    first, last = libheif(0, 0), libheif(width - 1, height - 1)
    assert (first[0] / 6, first[1] / 8) == (left, top)
    assert (last[0] / 6, last[1] / 8) == (left + width - 1, top + height - 1)


@pytest.mark.parametrize(
    "clap",
    [
        (0, 1, 30, 1, 0, 1, 0, 1),
        (50, 1, 30, 1, 0, 1, 0, 1),
        (20, 1, 30, 1, 15, 1, 0, 1),
        (20, 0, 30, 1, 0, 1, 0, 1),
    ],
)
def test_clean_aperture_outside_the_image_is_corrupt(clap: tuple[int, ...]) -> None:
    """An empty aperture, one larger than the image or moved past its edge is corrupt_image."""
    with pytest.raises(CorruptImageError, match="clap"):
        isobmff.clean_aperture(struct.pack(">IIIIiIiI", *clap), 40, 30)


def test_transform_steps_carry_the_size_along() -> None:
    """Steps are in association order; a quarter turn swaps the size the next clap sees."""
    data = hc.transformed(
        quadrants_hevc(), props([("irot", (1,)), ("clap", (100, 50, 0, 0)), ("imir", (1,))])
    )
    container = isobmff.check(data)
    assert isobmff.transform_steps(container, 1, 1436, 730) == [
        isobmff.Step("rotate", (1,)),
        isobmff.Step("crop", (315, 693, 100, 50)),
        isobmff.Step("mirror", (1,)),
    ]


def test_budget_counts_the_decode_before_the_crop() -> None:
    """The budget covers the 1436×730 decode, not the 424×246 shown: inclusive, to the pixel."""
    data = hc.transformed(quadrants_hevc(), props([CROP, ("irot", (1,))]))
    assert rendered(data, 1436 * 730).width == 246
    with pytest.raises(ImageTooLargeError, match="1436x730"):
        pipeline.render(data, FULL, 1436 * 730 - 1)


@pytest.mark.parametrize("fmt", ["heic", "avif"])
def test_bomb_cropped_by_clap_is_too_large(fmt: str) -> None:
    """A 60000×60000 px image cropped to 16×16, or an overlay input as big, is image_too_large."""
    tile = hc.Tile(sample(f"sample.{fmt}"))
    bomb = hc.Item(
        1,
        tile.item_type,
        tile.coded,
        [(tile.config, True), (hc.ispe(60000, 60000), False), (hc.clap(16, 16), True)],
    )
    with pytest.raises(ImageTooLargeError, match="60000x60000"):
        pipeline.render(hc.heif(tile.brand, [bomb], []), FULL, BUDGET)
    canvas = hc.overlay_descriptor(48, 32, [(0, 0)], (0, 0, 0, 65535))
    overlay = hc.Item(2, b"iovl", canvas, [(hc.ispe(48, 32), False)])
    with pytest.raises(ImageTooLargeError, match="60000x60000"):
        pipeline.render(
            hc.heif(tile.brand, [overlay, bomb], [(b"dimg", 2, [1])], primary=2), FULL, BUDGET
        )


CYAN = (0, 65535, 65535, 65535)


@pytest.mark.parametrize("fmt", ["heic", "avif"])
@pytest.mark.parametrize("inside", [False, True])
def test_overlay_placing_one_image_twice_renders(fmt: str, inside: bool) -> None:
    """An overlay placing one image twice renders; a placement outside the canvas adds nothing."""
    tile = quadrants_hevc() if fmt == "heic" else hc.Tile(sample("sample.avif"))
    tw, th = tile.size
    image = rendered(hc.overlay_twice(tile, (tw, 0) if inside else (5 * tw, 0), CYAN))
    assert (image.width, image.height) == (2 * tw, th)
    for dx in (0, tw):
        shown = [
            colour_at(image, dx + u, v)
            for u, v in ((2, 2), (tw - 3, 2), (2, th - 3), (tw - 3, th - 3))
        ]
        if dx == 0 or inside:
            assert shown == [RED, GREEN, BLUE, WHITE]
        else:
            assert image(dx + tw // 2, th // 2)[:3] == [0, 255, 255]  # the canvas' fill


def test_libheif_alone_refuses_an_overlay_naming_one_image_twice() -> None:
    """The failure this fixes: libheif 1.23 takes a repeated reference as corrupt."""
    pi_heif.options.DISABLE_SECURITY_LIMITS = True
    with pytest.raises(ValueError, match="double references"):
        _ = pi_heif.open_heif(hc.overlay_twice(quadrants_hevc(), (5 * 1436, 0), CYAN)).data


@pytest.mark.parametrize("primary", [1, 2])
def test_two_images_cropped_by_clap_render_the_primary(primary: int) -> None:
    """A file of two images, each cropped by its own clap, renders the primary at its crop."""
    first, second = ("clap", (424, 246, -150, 60)), ("clap", (300, 200, 32, -15))
    data = hc.two_cropped(quadrants_hevc(), hc.clap(*first[1]), hc.clap(*second[1]), primary)
    ops = [first if primary == 1 else second]
    image = rendered(data)
    assert (image.width, image.height) == ops[0][1][:2]
    assert_corners(image, ops, (1436, 730))


def test_two_avif_images_cropped_by_clap_render_the_primary() -> None:
    """The same in AVIF: the primary's crop, not the other image's."""
    tile = hc.Tile(sample("sample.avif"))
    data = hc.two_cropped(tile, hc.clap(10, 10), hc.clap(20, 24), primary=2)
    assert rendered(data).width == 20


LAYERS = {0: (360, 182), 1: (718, 366), 2: (1436, 730)}


@pytest.mark.parametrize(
    ("selection", "layer"),
    [
        ([], 2),  # no selection: every layer decoded, the last shown
        ([(hc.a1op(2), True)], 0),  # operating point 2 holds layer 0 only
        ([(hc.a1op(1), True)], 1),
        ([(hc.a1op(0), True)], 2),
        ([(hc.lsel(0), True)], 0),
        ([(hc.lsel(1), True)], 1),
        ([(hc.a1op(2), True), (hc.lsel(0), True)], 0),
        ([(hc.lsel(0xFFFF), True)], 2),  # lsel's "no layer"
    ],
)
@pytest.mark.parametrize("config_obus", [False, True])
def test_layered_av1_renders_the_selected_layer(
    selection: list[tuple[bytes, bool]], layer: int, config_obus: bool
) -> None:
    """A 3-layer AV1 image renders the layer a1op or lsel selects, at its size, upright."""
    data = hc.layered(layers_obu(), LAYERS[layer], selection, config_obus=config_obus)
    image = rendered(data)
    assert (image.width, image.height) == LAYERS[layer]
    assert_corners(image, [], LAYERS[layer])


def test_libheif_alone_refuses_the_selected_operating_point() -> None:
    """The failure this fixes, as in the conformance suite's quebec_3layer_op2.avif."""
    data = hc.layered(layers_obu(), LAYERS[0], [(hc.a1op(2), True)])
    with pytest.raises(
        pyvips.Error, match="Image size 1436x730 exceeds the maximum image size 151280"
    ):
        pyvips.Image.new_from_buffer(data, "", unlimited=True).avg()


def test_missing_operating_point_is_corrupt() -> None:
    """An a1op naming an operating point the sequence header does not have is corrupt_image."""
    with pytest.raises(CorruptImageError, match="operating point 5"):
        pipeline.render(hc.layered(layers_obu(), LAYERS[0], [(hc.a1op(5), True)]), FULL, BUDGET)


def test_layered_budget_counts_the_selected_layer() -> None:
    """The budget applies to the layer decoded: 360×182 px is enough for operating point 2."""
    data = hc.layered(layers_obu(), LAYERS[0], [(hc.a1op(2), True)])
    assert rendered(data, 360 * 182).width == 360
    with pytest.raises(ImageTooLargeError):
        pipeline.render(data, FULL, 360 * 182 - 1)


@pytest.mark.parametrize(
    "ops",
    [
        [CROP],
        [("irot", (1,))],
        [("irot", (3,)), ("imir", (1,))],
        [("imir", (0,))],
        [CROP, ("irot", (1,)), ("imir", (0,))],
    ],
)
def test_hevc_non_essential_transformative_properties_apply(
    ops: list[tuple[str, tuple[int, ...]]],
) -> None:
    """A HEVC clap, irot or imir not marked essential crops, turns and mirrors as asked."""
    unmarked = [(prop, False) for prop, _ in props(ops)]
    image = rendered(hc.transformed(quadrants_hevc(), unmarked))
    size = (424, 246) if ops[0] == CROP else (1436, 730)
    turned = any(op == "irot" and args[0] % 2 for op, args in ops)
    assert (image.width, image.height) == (size[::-1] if turned else size)
    assert_corners(image, ops, (1436, 730))


def test_hevc_non_essential_clap_outside_the_image_is_corrupt() -> None:
    """Unmarked or not, a clean aperture outside its image is still corrupt_image."""
    data = hc.transformed(quadrants_hevc(), [(hc.clap(424, 246, 900, 0), False)])
    with pytest.raises(CorruptImageError, match="does not fit") as caught:
        pipeline.render(data, FULL, BUDGET)
    assert caught.value.code == "corrupt_image"


@pytest.mark.parametrize("prop", [hc.clap(20, 20), hc.irot(1), hc.imir(0)])
def test_avif_non_essential_transformative_property_is_corrupt(prop: bytes) -> None:
    """In AVIF a clap, irot or imir not marked essential (libavif: BMFF parse failed) is corrupt."""
    data = hc.transformed(hc.Tile(sample("sample.avif")), [(prop, False)])
    with pytest.raises(CorruptImageError, match=f"non-essential {prop[4:8].decode()}") as caught:
        pipeline.render(data, FULL, BUDGET)
    assert caught.value.code == "corrupt_image"


@pytest.mark.parametrize("fmt", ["heic", "avif"])
def test_grid_naming_one_tile_twice_is_corrupt(fmt: str) -> None:
    """A grid naming the same tile twice (libavif: invalid image grid) is corrupt_image."""
    data = hc.grid_twice(hc.Tile(sample(f"sample.{fmt}")))
    with pytest.raises(CorruptImageError, match="references tile 2 more than once"):
        pipeline.render(data, FULL, BUDGET)


def test_sequence_header_of_the_layered_sample() -> None:
    """Operating points and maximum frame size are read, and the size rewritten in place."""
    payload, sizes = hc.temporal_unit_layers(layers_obu())
    seq = next(o for o in av1.obus(payload) if o.kind == av1.SEQUENCE_HEADER)
    header = av1.sequence_header(payload[seq.body : seq.end])
    assert header.operating_points == [0x701, 0x301, 0x101]
    assert (header.width_bits, header.height_bits) == (11, 10)
    obu = payload[seq.start : seq.end]
    smaller = av1.with_max_size(obu, seq.body - seq.start, 360, 182)
    assert len(smaller) == len(obu) and smaller != obu
    assert av1.with_max_size(smaller, seq.body - seq.start, 1436, 730) == obu
    assert av1.layers(payload) == 3 and len(sizes) == 3
    assert len(av1.cut(payload, 0, 360, 182)) == sizes[0]


@pytest.mark.parametrize(
    ("points", "op", "layer", "expected"),
    [
        ([0x701, 0x301, 0x101], None, None, None),
        ([0x701, 0x301, 0x101], 2, None, 0),
        ([0x701, 0x301, 0x101], 1, None, 1),
        ([0x701, 0x301, 0x101], 0, None, 2),
        ([0x701, 0x301, 0x101], 0, 1, 1),  # lsel names the layer within the point
        ([0x701, 0x301, 0x101], None, 0xFFFF, None),
        ([0], 0, None, None),  # idc 0: one layer, nothing to select
    ],
)
def test_output_layer_decision(
    points: list[int], op: int | None, layer: int | None, expected: int | None
) -> None:
    """lsel names the output layer; else a1op's point outputs its highest spatial layer."""
    assert av1.output_layer(points, op, layer) == expected


@pytest.mark.parametrize(
    "data",
    [
        sample("sample.heic"),
        sample("sample.avif"),
        (Path(__file__).parent / "photos" / "iphone_13_pro_max.HEIC").read_bytes(),
        (Path(__file__).parent / "photos" / "avif-orientation-6.avif").read_bytes(),
    ],
)
def test_rewrites_leave_ordinary_files_alone(data: bytes) -> None:
    """Ordinary files reach libheif byte for byte; pi-heif's copy only loses clap/irot/imir."""
    container = isobmff.check(data)
    assert heifedit.for_libheif(data, container, strip_transforms=False) == data
    stripped = heifedit.for_libheif(data, container, strip_transforms=True)
    has_transforms = any(k in isobmff.TRANSFORMS for k, _, _ in container.props(container.primary))
    assert (stripped != data) == has_transforms
    if has_transforms:
        bare = isobmff.check(stripped)
        assert not any(k in isobmff.TRANSFORMS for k, _, _ in bare.props(bare.primary))
        assert bare.items == container.items and bare.refs == container.refs


def test_rewritten_meta_moves_to_the_end() -> None:
    """A meta box that grows moves after the data, the old one freed: no item offset moves."""
    data = hc.overlay_twice(hc.Tile(sample("sample.avif")), (5 * 24, 0), CYAN)
    container = isobmff.check(data)
    out = heifedit.for_libheif(data, container, strip_transforms=False)
    start, end = container.meta_span
    assert out[start + 4 : start + 8] == b"free" and out[start:end][8:] == bytes(end - start - 8)
    clone = isobmff.check(out)
    assert clone.refs[0].targets == [2, 3] and clone.items[3] == clone.items[2]
    assert isobmff.item_data(out, clone, 3) == isobmff.item_data(data, container, 2)
