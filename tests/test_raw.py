"""Camera RAW originals (hand-made containers, tests/rawcraft.py): recognised by content,
rendered upright from the embedded preview with the camera's facts, refused cleanly
when no preview will do, when the header claims too many pixels, or when damaged."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import pyvips

from darkroom.errors import CorruptImageError, DarkroomError, UnsupportedFormatError
from darkroom.image import pipeline, raw
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
    }


def _upright_quadrants(data: bytes) -> None:
    image = pyvips.Image.new_from_buffer(data, "")
    assert (image.width, image.height) == (400, 600)  # stored 600×400, orientation 6
    assert image.interpretation == "srgb"
    expected = {(100, 150): (220, 30, 30), (300, 150): (30, 200, 30), (100, 450): (30, 60, 220)}
    for (x, y), colour in expected.items():
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
    """No usable preview, a CR3, a huge header and a damaged preview fail with their codes."""
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
    for code, data in [*cases.items(), ("unsupported_format", rawcraft.cr3())]:
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
        raw.preview(data, "nef", 600, 100_000_000)


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
    """The start-up self-check covers RAW: its DNG sample decodes upright with colours."""
    from darkroom.image import selfcheck

    [check] = [c for c in selfcheck.run([]) if c.name == "decode dng"]
    assert check.ok, check.detail


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


def _outcome(data: bytes) -> str:
    try:
        pipeline.render(data, SPECS, 100_000_000)
    except DarkroomError as exc:
        return exc.code
    return "rendered"
