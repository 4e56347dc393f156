"""Camera RAW originals (hand-made containers, tests/rawcraft.py): recognised by content,
rendered upright from the embedded preview with the camera's facts, refused cleanly
when no preview will do, when the header claims too many pixels, or when damaged."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import pyvips

from darkroom.errors import (
    CorruptImageError,
    DarkroomError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from darkroom.image import cr3, exif, pipeline, raw, rawdecode
from darkroom.settings import RenditionSpec
from tests import rawcraft
from tests.conftest import Env

RENDITIONS = "thumb:160:webp:80,large:600:jpeg:85"
SPECS = [RenditionSpec("large", 600, "png", 100)]


def _cameras() -> dict[str, tuple[bytes, str]]:
    """Each kind's file, by the name it is saved under (never the kind's extension)."""
    fuji = rawcraft.with_exif(rawcraft.preview(600, 400, orientation=6), "FUJIFILM", 6)
    return {
        "dng": (rawcraft.tiff_raw("Leica Camera AG", layout="dng"), "Leica Camera AG"),
        "cr2": (rawcraft.cr2(), "Canon"),
        "nef": (
            rawcraft.tiff_raw("NIKON CORPORATION", order=">", layout="subifd-jpeg"),
            "NIKON CORPORATION",
        ),
        "arw": (rawcraft.tiff_raw("SONY", layout="ifd0-jpeg"), "SONY"),
        "rw2": (rawcraft.tiff_raw("Panasonic", layout="rw2", magic=b"IIU\0"), "Panasonic"),
        "orf": (rawcraft.tiff_raw("OLYMPUS IMAGING CORP.", magic=b"IIRO"), "OLYMPUS IMAGING CORP."),
        "raf": (rawcraft.raf(fuji), "FUJIFILM"),
        "cr3": (
            rawcraft.cr3_with(rawcraft.preview(600, 400, orientation=6), orientation=6),
            "Canon",
        ),
    }


def _upright_quadrants(data: bytes, size: tuple[int, int] = (400, 600)) -> None:
    image = pyvips.Image.new_from_buffer(data, "")
    assert (image.width, image.height) == size  # stored turned, orientation 6
    assert image.interpretation == "srgb"
    colours = {(1, 1): (220, 30, 30), (3, 1): (30, 200, 30), (1, 3): (30, 60, 220)}
    for (qx, qy), colour in colours.items():
        x, y = qx * size[0] // 4, qy * size[1] // 4
        got = image(x, y)[:3]
        assert max(abs(a - b) for a, b in zip(got, colour, strict=True)) < 30, (x, y, got)


def test_every_kind_is_recognised_from_its_bytes() -> None:
    """Each RAW kind is named from content; a plain TIFF and a CR3 are told apart."""
    for kind, (data, _) in _cameras().items():
        assert pipeline.sniff(data) == kind
    assert pipeline.sniff(rawcraft.cr3()) == "cr3"
    with pytest.raises(UnsupportedFormatError):
        pipeline.sniff(rawcraft.tiff_raw("Acme Scanners"))  # a TIFF from no camera


def test_raw_files_through_the_worker(file_env: Env, tmp_path: Path) -> None:
    """Every kind is processed: upright sRGB renditions and the camera's make, model, time."""
    cameras = _cameras()
    paths = []
    for kind, (data, _) in cameras.items():
        path = tmp_path / f"{kind}-original.bin"  # the name says nothing of the format
        path.write_bytes(data)
        paths.append(path)
    ids = file_env.ingest(paths)
    file_env.cli("run", "--drain", DARKROOM_RENDITIONS=RENDITIONS)
    rows = {r["id"]: r for r in file_env.query("SELECT * FROM photos")}
    for photo_id, (kind, (_, make)) in zip(ids, cameras.items(), strict=True):
        row = rows[photo_id]
        assert row["processing_state"] == "processed", (kind, row["error_code"])
        assert (row["format"], row["width"], row["height"]) == (kind, 400, 600)
        assert row["camera_make"] == make
        assert row["camera_model"] and row["taken_at_local"], kind
        large = next(r for r in json.loads(row["renditions"]) if r["name"] == "large")
        _upright_quadrants((file_env.tmp / "var" / "storage" / large["key"]).read_bytes())


def test_refusals_through_the_worker(file_env: Env, tmp_path: Path) -> None:
    """No usable preview and raw data LibRaw does not take, a huge header, a damaged preview
    and a CR3 cut after its `ftyp` fail with their codes."""
    cases = {
        "unsupported_format": rawcraft.tiff_raw(
            "Canon", layout="dng", sensor=(6000, 4000), jpeg=rawcraft.preview(160, 120)
        ),
        "image_too_large": rawcraft.tiff_raw(
            "Canon", layout="dng", sensor=(100_000, 100_000), jpeg=rawcraft.preview(600, 400)
        ),
        "corrupt_image": rawcraft.tiff_raw("SONY", layout="ifd0-jpeg", jpeg=_damaged_jpeg()),
    }
    paths = []
    for code, data in [*cases.items(), ("corrupt_image", rawcraft.cr3())]:
        paths.append(tmp_path / f"{code}-{len(paths)}.dng")
        paths[-1].write_bytes(data)
    ids = file_env.ingest(paths)
    file_env.cli("run", "--drain", DARKROOM_RENDITIONS=RENDITIONS, DARKROOM_MAX_PIXELS="50000000")
    rows = {
        r["id"]: r for r in file_env.query("SELECT id, processing_state, error_code FROM photos")
    }
    for photo_id, path in zip(ids, paths, strict=True):
        expected = path.name.split("-")[0]
        assert (rows[photo_id]["processing_state"], rows[photo_id]["error_code"]) == (
            "processing_failed", expected), path.name  # fmt: skip


def _stored(upright: pyvips.Image, orientation: int) -> pyvips.Image:
    """The picture as a sensor stores it for `orientation` 1 or 6 (shown a quarter turn
    clockwise)."""
    return upright.rot("d270") if orientation == 6 else upright


def test_a_dng_whose_previews_are_too_small_is_decoded_from_its_sensor_data(
    file_env: Env, tmp_path: Path
) -> None:
    """A DNG with a 160×120 preview and real Bayer data: LibRaw demosaics the sensor's data
    (a 600×400 RGGB mosaic stored on its side), so the renditions are its full size,
    upright, in sRGB, with the DNG's own make and capture time; one with only a preview that
    small and no raw data LibRaw takes is refused (above)."""
    upright = rawcraft.quadrants(400, 600)
    data = rawcraft.bayer_dng(_stored(upright, 6), 6, jpeg=rawcraft.preview(160, 120))
    path = tmp_path / "sensor-original.bin"
    path.write_bytes(data)
    [photo_id] = file_env.ingest([path])
    file_env.cli("run", "--drain", DARKROOM_RENDITIONS=RENDITIONS)
    [row] = file_env.query("SELECT * FROM photos WHERE id = $1", photo_id)
    assert row["processing_state"] == "processed", row["error_code"]
    assert (row["format"], row["width"], row["height"]) == ("dng", 400, 600)
    assert (row["camera_make"], row["taken_at_local"].year) == ("Leica", 2025)
    large = next(r for r in json.loads(row["renditions"]) if r["name"] == "large")
    assert (large["width"], large["height"]) == (400, 600)  # the sensor's, not the preview's
    _upright_quadrants((file_env.tmp / "var" / "storage" / large["key"]).read_bytes())


def test_a_cut_preview_gives_no_tones_to_a_sensor_decode() -> None:
    """The camera's preview is the tone reference only when it decodes whole: a cut one (its
    size still read from its header) leaves LibRaw's own rendering, not a curve bent towards
    the grey a lenient decode fills it with."""
    whole = rawcraft.preview(120, 80)
    cut = whole[: len(whole) // 2]
    picture = rawcraft.quadrants(120, 80)
    assert raw.jpeg_size(cut) == (120, 80)
    assert rawdecode._camera_look(rawcraft.bayer_dng(picture, 1, jpeg=whole), "dng", 10**8)
    assert rawdecode._camera_look(rawcraft.bayer_dng(picture, 1, jpeg=cut), "dng", 10**8) is None


def test_a_sensor_twice_the_largest_rendition_is_decoded_at_half_size() -> None:
    """Half the sensor still covers the rendition: LibRaw's half-size decode (a pixel per
    Bayer cell) renders it, upright and in colour; the facts keep the sensor's full size."""
    assert raw.half_size(2400, 1600, 600) and not raw.half_size(1000, 800, 600)
    data = rawcraft.bayer_dng(_stored(rawcraft.quadrants(1600, 2400), 6), 6)
    result = pipeline.render(data, [RenditionSpec("large", 600, "png", 100)], 50_000_000)
    assert (result.facts.format, result.facts.width, result.facts.height) == ("dng", 1600, 2400)
    [large] = result.renditions
    assert (large.width, large.height) == (400, 600)
    _upright_quadrants(large.data)


def test_libraws_renditions_keep_a_cropped_box_whole_and_its_facts_upright() -> None:
    """A cropped square from sensor data is the box's size (the decode kept the cover the
    crop needs, judged on the sensor's shape), and a transposing orientation (5 to 8)
    reports the sensor's size turned as the pixels are."""
    from darkroom.image import rawdecode

    data = rawcraft.bayer_dng(rawcraft.quadrants(600, 400), jpeg=rawcraft.preview(40, 30))
    specs = [RenditionSpec("sq", 300, "jpeg", 85, box=(300, 300), crop="centre")]
    [square] = pipeline.render(data, specs, 50_000_000).renditions
    assert (square.width, square.height) == (300, 300)
    assert rawdecode._upright(600, 400, (600, 400, 3)) == (400, 600)  # turned: portrait out
    assert rawdecode._upright(600, 400, (400, 600, 3)) == (600, 400)


def test_a_sensor_past_the_budget_renders_from_a_preview_that_serves() -> None:
    """A sensor over DARKROOM_MAX_PIXELS (a 102 MP camera's, scaled down here) with a
    preview short of the largest rendition but over 1,024 px: the preview renders, as it
    did before LibRaw, rather than `image_too_large`."""
    data = rawcraft.bayer_dng(rawcraft.quadrants(1600, 1200), jpeg=rawcraft.preview(1100, 824))
    result = pipeline.render(data, [RenditionSpec("large", 2048, "png", 100)], 1_500_000)
    assert (result.facts.width, result.facts.height) == (1100, 824)


def test_without_libraw_a_smaller_preview_serves_and_none_is_unsupported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker where LibRaw cannot load: a 1,200 px preview renders (the renditions stop at
    its size), and the Bayer DNG LibRaw would have decoded, whose preview is 160 px, is
    `unsupported_format` naming the size it needed (its 600 px sensor's)."""
    from darkroom.image import rawdecode

    monkeypatch.setattr(rawdecode, "available", lambda: False)
    specs = [RenditionSpec("large", 2048, "png", 100)]
    served = rawcraft.tiff_raw("Canon", layout="dng", sensor=(6000, 4000),
                               jpeg=rawcraft.preview(1200, 800))  # fmt: skip
    assert pipeline.render(served, specs, 50_000_000).renditions[0].height == 1200
    small = rawcraft.bayer_dng(rawcraft.quadrants(600, 400), jpeg=rawcraft.preview(160, 120))
    with pytest.raises(UnsupportedFormatError, match="160x120 is smaller than the 600 px needed"):
        pipeline.render(small, specs, 50_000_000)


def test_a_sensor_past_the_pixel_budget_is_refused_before_its_data_is_unpacked() -> None:
    """LibRaw reads the sensor's size from the header; past DARKROOM_MAX_PIXELS it is
    `image_too_large` (the DNG's declared size is under the preview path's 4× allowance)."""
    from darkroom.errors import ImageTooLargeError

    data = rawcraft.bayer_dng(rawcraft.quadrants(600, 400))
    with pytest.raises(ImageTooLargeError, match="RAW sensor 600x400"):
        pipeline.render(data, [RenditionSpec("large", 600, "png", 100)], 200_000)


def _damaged_jpeg() -> bytes:
    """A preview whose header is whole but whose entropy-coded data is cut short."""
    jpeg = rawcraft.preview(600, 400)
    return jpeg[: jpeg.find(b"\xff\xda") + 200]


def test_huge_header_is_refused_before_any_decode() -> None:
    """The pixel budget applies to the sensor size the IFDs declare, before the preview."""
    data = rawcraft.tiff_raw("NIKON CORPORATION", order=">", layout="subifd-jpeg",
                             sensor=(60_000, 40_000), jpeg=b"not even a jpeg")  # fmt: skip
    from darkroom.errors import ImageTooLargeError

    with pytest.raises(ImageTooLargeError):
        raw.preview(data, "nef", 600, 100_000_000, decoder=True)


def test_damaged_structures_are_corrupt_not_crashes() -> None:
    """A CR2 whose IFD0 points past the end, and an IFD loop, give corrupt_image or render."""
    good = rawcraft.cr2()
    past_end = good[:4] + (len(good) + 100).to_bytes(4, "little") + good[8:]
    with pytest.raises(CorruptImageError):
        pipeline.render(past_end, SPECS, 100_000_000)
    first = int.from_bytes(good[4:8], "little")
    count = int.from_bytes(good[first : first + 2], "little")
    end = first + 2 + 12 * count
    looped = good[:end] + first.to_bytes(4, "little") + good[end + 4 :]  # IFD0 → IFD0
    assert pipeline.render(looped, SPECS, 100_000_000).facts.format == "cr2"


def test_selfcheck_decodes_the_dng_sample() -> None:
    """The start-up self-check covers RAW: its DNG sample's preview decodes upright with
    colours, and so does a DNG's sensor data through LibRaw."""
    from darkroom.image import selfcheck

    checks = {c.name: c for c in selfcheck.run([])}
    assert checks["decode dng"].ok, checks["decode dng"].detail
    sensor = checks["decode RAW sensor data (LibRaw)"]  # LibRaw is installed here
    assert sensor.ok and "demosaiced" in sensor.detail, sensor.detail


def test_damaged_raw_files_give_codes_never_crashes() -> None:
    """Truncations and byte flips of every kind end in a render or a coded error only."""
    rng, outcomes = random.Random(20261205), []
    for data, _ in _cameras().values():
        for _ in range(60):
            cut = rng.randrange(8, len(data)) if rng.random() < 0.3 else len(data)
            damaged = bytearray(data[:cut])
            for _ in range(rng.randrange(1, 6)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            outcomes.append(_outcome(bytes(damaged)))
    assert set(outcomes) <= {"rendered", "unsupported_format", "corrupt_image", "image_too_large"}
    assert {"rendered", "corrupt_image"} <= set(outcomes)  # the damage reached both ways


def test_a_cr3_renders_from_its_full_size_jpeg_when_that_covers() -> None:
    """A CR3's first track holds the camera's full-size JPEG: it serves where it covers the
    renditions (the 300 px PRVW would not), upright by CMT1's orientation, no LibRaw run."""
    full = rawcraft.preview(1200, 800, orientation=6)
    data = rawcraft.cr3_with(rawcraft.preview(300, 200, orientation=6), orientation=6, full=full)
    result = pipeline.render(data, [RenditionSpec("large", 1000, "png", 100)], 100_000_000)
    assert (result.facts.format, result.facts.width, result.facts.height) == ("cr3", 800, 1200)
    [large] = result.renditions
    _upright_quadrants(large.data, (667, 1000))


def test_a_cr3s_full_size_jpeg_past_the_budget_leaves_its_prvw_to_serve() -> None:
    """A lowered DARKROOM_MAX_PIXELS under the camera's JPEG size: the PRVW that fits renders;
    `image_too_large` only when no JPEG of the file fits."""
    full = rawcraft.preview(1600, 1066)
    data = rawcraft.cr3_with(rawcraft.preview(1100, 732), full=full)
    spec = [RenditionSpec("large", 2000, "png", 100)]
    assert pipeline.render(data, spec, 1_000_000).facts.width == 1100
    assert pipeline.render(data, spec, 100_000_000).facts.width == 1600
    with pytest.raises(ImageTooLargeError):
        pipeline.render(data, spec, 500_000)


def test_only_the_first_tracks_sample_is_a_cr3_preview_candidate() -> None:
    """The other tracks hold the sensor data (tens of MB): not copied or walked as JPEGs, even
    when a forged file has hundreds of tracks naming a JPEG; `stco` read as `co64` is."""
    full = rawcraft.preview(800, 600)
    data = rawcraft.cr3_with(rawcraft.preview(300, 200), full=full, tracks=200)
    assert len(cr3.previews(data)) == 2  # the PRVW and the first track's
    narrow = rawcraft.cr3_with(rawcraft.preview(300, 200), full=full, offsets=b"stco")
    spans = cr3.previews(narrow)
    assert len(spans) == 2 and any(narrow[o : o + n] == full for o, n in spans)


def test_a_jpeg_whose_size_hides_past_many_segments_is_no_preview() -> None:
    """The SOF walk is bounded (it runs on the worker's loop for the memory estimate)."""
    jpeg = rawcraft.preview(64, 48)
    padded = jpeg[:2] + b"\xff\xe0\x00\x02" * 100_000 + jpeg[2:]
    assert raw.jpeg_size(jpeg) == (64, 48)
    assert raw.jpeg_size(padded) is None


def test_a_cr3s_gps_ifd_is_read_with_its_exif() -> None:
    """CMT4 is the GPS IFD: the location (kept with DARKROOM_KEEP_LOCATION) as for any RAW."""
    capture = exif.read(cr3.exif(rawcraft.cr3_with(rawcraft.preview(300, 200))))
    assert capture.camera_model == "Canon EOS Test"
    assert capture.latitude == pytest.approx(48.85) and capture.longitude == pytest.approx(2.35)


def test_damaged_cr3_boxes_give_codes_never_crashes() -> None:
    """A CR3's boxes and its CMT TIFFs (its first bytes, before the preview's JPEG) cut or
    flipped: 300 variants, each a render or a coded error."""
    base = rawcraft.cr3_with(rawcraft.preview(600, 400, orientation=6), orientation=6)
    rng, outcomes = random.Random(20261207), []
    head = base.find(b"PRVW") + 40
    for _ in range(300):
        cut = rng.randrange(8, head) if rng.random() < 0.2 else len(base)
        damaged = bytearray(base[:cut])
        for _ in range(rng.randrange(1, 6)):
            damaged[rng.randrange(min(len(damaged), head))] = rng.randrange(256)
        outcomes.append(_outcome(bytes(damaged)))
    assert set(outcomes) <= {"rendered", "unsupported_format", "corrupt_image", "image_too_large"}
    assert {"rendered", "corrupt_image"} <= set(outcomes)


def test_damaged_sensor_data_gives_codes_never_crashes() -> None:
    """A Bayer DNG (small preview, so LibRaw decodes it) cut short or with bytes flipped,
    mostly in its header and IFDs: 300 variants, each a render or a coded error (LibRaw
    runs in this process here, so a crash would end the test)."""
    base = rawcraft.bayer_dng(rawcraft.quadrants(120, 80), 6, jpeg=rawcraft.preview(40, 30))
    rng, outcomes = random.Random(20261206), []
    for _ in range(300):
        cut = rng.randrange(8, len(base)) if rng.random() < 0.3 else len(base)
        damaged = bytearray(base[:cut])
        for _ in range(rng.randrange(1, 6)):
            near_start = rng.random() < 0.8
            damaged[rng.randrange(min(len(damaged), 2000) if near_start else len(damaged))] = (
                rng.randrange(256)
            )
        outcomes.append(_outcome(bytes(damaged)))
    assert set(outcomes) <= {"rendered", "unsupported_format", "corrupt_image", "image_too_large"}
    assert {"rendered", "unsupported_format"} <= set(outcomes)


def _outcome(data: bytes) -> str:
    try:
        pipeline.render(data, SPECS, 100_000_000)
    except DarkroomError as exc:
        return exc.code
    return "rendered"
