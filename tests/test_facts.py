"""Facts, placeholders, self-check and re-render: the pure parts against
reference data, then everything through the real worker, read back from PostgreSQL."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pyvips

from darkroom.image import exif, placeholders, thumbhash
from tests.conftest import PHOTOS, Env
from tests.exifcraft import RATIONAL, ascii_entries, hostile_blocks, tiff, with_exif

CORPUS = Path(__file__).parents[1].parent / "shared" / "corpus"
VECTORS = json.loads((Path(__file__).parent / "thumbhash_vectors.json").read_text())


# --- ThumbHash against the reference implementation (evanw/thumbhash, npm `thumbhash`) ---


def _vector_image(w: int, h: int, kind: int) -> bytes:
    """The images the vectors were made from (same formulas as the generating script)."""
    out = bytearray()
    for y in range(h):
        for x in range(w):
            if kind == 1:
                out += bytes([(x * 7 + y * 13) % 256, (x * x + y) % 256, (x * y) % 256, 255])
            else:
                out += bytes([200, (x * 3) % 256, (y * 5) % 256, ((x + y) * 4) % 256])
    return bytes(out)


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"{v['w']}x{v['h']}-{v['kind']}")
def test_thumbhash_matches_reference_vectors(vector: dict[str, Any]) -> None:
    image = _vector_image(vector["w"], vector["h"], vector["kind"])
    hashed = thumbhash.encode(vector["w"], vector["h"], image)
    assert base64.b64encode(hashed).decode() == vector["hash"]
    w, h, rgba = thumbhash.decode(base64.b64decode(vector["hash"]))
    assert (w, h) == (vector["decoded_w"], vector["decoded_h"])
    assert rgba == base64.b64decode(vector["decoded_rgba"])


RANDOM_VECTORS = json.loads((Path(__file__).parent / "thumbhash_random_vectors.json").read_text())


def _noise_image(w: int, h: int, mode: str, seed: int) -> bytes:
    """Seeded noise (xorshift32), as tests/thumbhash_random.mjs makes it for the reference."""
    x, out = seed, bytearray()

    def next_byte() -> int:
        nonlocal x
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        return x & 255

    for _ in range(w * h):
        out += bytes(next_byte() for _ in range(3))
        a = next_byte()
        out.append(255 if mode == "opaque" else (255 if a & 1 else 0) if mode == "binary" else a)
    return bytes(out)


@pytest.mark.parametrize("vector", RANDOM_VECTORS, ids=lambda v: f"{v['w']}x{v['h']}-{v['mode']}")
def test_thumbhash_matches_the_reference_on_noise(vector: dict[str, Any]) -> None:
    """Byte for byte with npm `thumbhash` on noise images, opaque, with binary alpha and with
    partial alpha; the first eight with a luminance count on a half, which the reference
    rounds up (7 × 30 / 84 = 2.5: the header's shape; 7 × 18 / 28 = 4.5: 5 rows, not 4)."""
    image = _noise_image(vector["w"], vector["h"], vector["mode"], vector["seed"])
    hashed = thumbhash.encode(vector["w"], vector["h"], image)
    assert base64.b64encode(hashed).decode() == vector["hash"]


def test_thumbhash_of_a_flat_image_has_no_detail_terms() -> None:
    """A flat colour hashes to its colour and all-zero detail, not to summation noise."""
    hashed = thumbhash.encode(40, 30, bytes([10, 120, 200, 255]) * 1200)
    assert hashed[5:] == bytes(len(hashed) - 5)
    assert [round(c * 255) for c in thumbhash.average_rgba(hashed)[:3]] == [10, 119, 198]


def test_thumbhash_refuses_large_images() -> None:
    with pytest.raises(ValueError, match="100x100"):
        thumbhash.encode(101, 10, bytes(101 * 10 * 4))


def test_dominant_colour_is_the_largest_area_not_the_mean() -> None:
    """A red boat on blue water is blue."""
    water, boat = bytes([30, 70, 200, 255]), bytes([220, 20, 20, 255])
    pixels = water * 6000 + boat * 4000
    colour, share = placeholders.dominant_color(pixels) or ("", 0.0)
    assert colour == "#1e46c8" and share == pytest.approx(0.6)
    assert placeholders.dominant_color(bytes([1, 2, 3, 0]) * 10) is None  # nothing visible


# --- EXIF: dates, offsets, placeholders, damage ---------------------------------------


def _block(main: dict[int, str], sub: dict[int, str]) -> bytes:
    """A TIFF block: ASCII tags in IFD0 and an EXIF sub-IFD with ASCII tags."""
    main_entries, main_blob = ascii_entries(main, 0)
    n_main = len(main_entries) + 1
    sub_at = 8 + 2 + 12 * n_main + 4
    sub_entries, sub_blob = ascii_entries(sub, 0)
    blobs_at = sub_at + 2 + 12 * len(sub_entries) + 4
    main_entries, main_blob = ascii_entries(main, blobs_at)
    sub_entries, sub_blob = ascii_entries(sub, blobs_at + len(main_blob))
    sub_ifd = struct.pack("<H", len(sub_entries))
    for tag, kind, count, value in sub_entries:
        sub_ifd += struct.pack("<HHI", tag, kind, count) + value.ljust(4, b"\0")
    sub_ifd += struct.pack("<I", 0)
    entries = [*main_entries, (0x8769, 4, 1, struct.pack("<I", sub_at))]
    entries.sort(key=lambda e: e[0])
    return tiff(entries, {1: sub_ifd, 2: main_blob, 3: sub_blob})


NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("original", "subsec", "offset", "local", "instant"),
    [
        ("2021:06:01 10:20:30", "25", "+02:00", datetime(2021, 6, 1, 10, 20, 30, 250000),
         datetime(2021, 6, 1, 8, 20, 30, 250000, tzinfo=UTC)),
        ("2021:06:01 10:20:30", "", "", datetime(2021, 6, 1, 10, 20, 30), None),
        ("0000:00:00 00:00:00", "", "+02:00", None, None),
        ("    :  :     :  :  ", "", "", None, None),
        ("1825:12:31 23:59:59", "", "", None, None),
        ("2026:01:03 00:00:00", "", "", None, None),  # more than a day ahead
        ("2021:13:01 10:20:30", "", "", None, None),
        ("2021:06:01 10:20:30", "", "+25:00", datetime(2021, 6, 1, 10, 20, 30), None),
    ],
)  # fmt: skip
def test_capture_time_rules(
    original: str, subsec: str, offset: str, local: datetime | None, instant: datetime | None
) -> None:
    sub = {0x9003: original, **({0x9291: subsec} if subsec else {})}
    sub |= {0x9011: offset} if offset else {}
    capture = exif.read(_block({0x010F: "  Maker\0\0 ", 0x0110: "Model X"}, sub), now=NOW)
    assert (capture.taken_at_local, capture.taken_at) == (local, instant)
    assert (capture.camera_make, capture.camera_model) == ("Maker", "Model X")


def test_digitized_time_is_the_fallback() -> None:
    capture = exif.read(_block({}, {0x9004: "2019:02:03 04:05:06"}), now=NOW)
    assert capture.taken_at_local == datetime(2019, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("name", sorted(hostile_blocks()))
def test_hostile_exif_blocks_give_no_facts(name: str) -> None:
    assert exif.read(hostile_blocks()[name]) == exif.Capture()


def test_rational_with_zero_denominator_is_null() -> None:
    block = tiff([(0x829D, RATIONAL, 1, struct.pack("<I", 26))]) + struct.pack("<II", 28, 0)
    assert exif.read(block).exposure is None


# --- through the real worker ----------------------------------------------------------

# What each file's own EXIF says (read with exiftool): make, model, local time, instant.
EXPECTED: dict[str, dict[str, Any]] = {
    "iphone_13_pro_max.HEIC": {  # HEIC with OffsetTimeOriginal +01:00
        "camera_make": "Apple", "camera_model": "iPhone 13 Pro Max",
        "lens_model": "iPhone 13 Pro Max back triple camera 5.7mm f/1.5",
        "taken_at_local": datetime(2022, 2, 16, 12, 55, 41, 762000),
        "taken_at": datetime(2022, 2, 16, 11, 55, 41, 762000, tzinfo=UTC),
        "exposure": {"f_number": 1.5, "exposure_time_s": 0.016667, "iso": 250,
                     "focal_length_mm": 5.7, "focal_length_35mm": 26},
        "source_profile": "Display P3",
    },
    "iphone_hdr_NO.jpg": {  # JPEG without an offset: the instant from the GPS clock
        "camera_make": "Apple", "camera_model": "iPhone 6",
        "taken_at_local": datetime(2015, 4, 10, 20, 12, 23, 16000),
        "taken_at": datetime(2015, 4, 10, 18, 12, 22, 60000, tzinfo=UTC),
        "source_profile": None,
    },
    "jpg-24bit-icc-adobe-rgb.jpg": {  # JPEG with neither offset nor GPS: no instant
        "camera_make": "Canon", "camera_model": "Canon EOS 5D Mark II",
        "lens_model": "EF85mm f/1.2L II USM",
        "taken_at_local": datetime(2014, 7, 14, 22, 37, 50, 260000), "taken_at": None,
        "exposure": {"f_number": 3.5, "exposure_time_s": 0.00125, "iso": 125,
                     "focal_length_mm": 85.0},
        "source_profile": "Adobe RGB (1998)",
    },
    "avif-orientation-6.avif": {  # AVIF: EXIF item, GPS date without a time: no instant
        "camera_make": "Apple", "camera_model": "iPhone XS",
        "taken_at_local": datetime(2020, 3, 5, 11, 28, 10, 150000), "taken_at": None,
        "source_profile": "Display P3",
    },
    "png-alpha-64bit.png": {  # PNG without EXIF
        "camera_make": None, "camera_model": None, "lens_model": None, "exposure": None,
        "taken_at_local": None, "taken_at": None, "has_alpha": True,
        "source_profile": "GIMP built-in sRGB",
    },
    "animated-loop-3.gif": {"frames": 10, "camera_make": None, "has_alpha": False},
    "Channel_digital_image_CMYK_color.jpg": {
        "camera_make": "Canon", "camera_model": "Canon EOS 300D DIGITAL",
        "taken_at_local": datetime(2004, 3, 20, 14, 54, 55), "taken_at": None,
        "source_profile": "U.S. Web Coated (SWOP) v2", "frames": 1,
    },
}  # fmt: skip
EXIF_PHOTOS = Path(__file__).parent / "exif-photos"
NOKIA = {  # JPEG with OffsetTimeOriginal +03:00
    "camera_make": "HMD Global", "camera_model": "Nokia 8.3 5G", "lens_model": None,
    "taken_at_local": datetime(2022, 8, 14, 14, 12, 31),
    "taken_at": datetime(2022, 8, 14, 11, 12, 31, tzinfo=UTC),
    "exposure": {"f_number": 2.2, "exposure_time_s": 0.000541, "iso": 100,
                 "focal_length_mm": 2.75},
}  # fmt: skip
CORPUS_EXPECTED = {
    "HMD_Nokia_8.3_5G.jpg": {  # JPEG with OffsetTimeOriginal +03:00
        "camera_make": "HMD Global", "camera_model": "Nokia 8.3 5G",
        "taken_at_local": datetime(2022, 8, 14, 14, 12, 31),
        "taken_at": datetime(2022, 8, 14, 11, 12, 31, tzinfo=UTC),
    },
}  # fmt: skip


def _photos() -> list[tuple[Path, dict[str, Any]]]:
    chosen = [(PHOTOS / name, facts) for name, facts in EXPECTED.items()]
    chosen.append((EXIF_PHOTOS / "HMD_Nokia_8.3_5G-800.jpg", NOKIA))
    if CORPUS.is_dir():
        chosen += [(CORPUS / name, facts) for name, facts in CORPUS_EXPECTED.items()]
    return chosen


def _fetch(env: Env, key: str) -> bytes:
    return (env.tmp / "var" / "storage" / key).read_bytes()


def _average(data: bytes) -> tuple[float, ...]:
    """Alpha-weighted average colour (0..1), as ThumbHash defines it."""
    image = pyvips.Image.new_from_buffer(data, "").colourspace("srgb")
    if not image.hasalpha():
        return tuple(image[i].avg() / 255 for i in range(3))
    alpha = image[3] / 255
    weight = alpha.avg()
    return tuple((image[i] * alpha).avg() / weight / 255 for i in range(3))


def _share(data: bytes, colour: str) -> float:
    """Share of the visible pixels within a small distance of `colour`."""
    image = pyvips.Image.new_from_buffer(data, "").colourspace("srgb")
    target = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    rgb = image.extract_band(0, n=3)
    close = (rgb - target) ** 2
    distance = (close[0] + close[1] + close[2]) ** 0.5
    near = distance < 48
    if image.hasalpha():
        visible = image[3] > 127
        return float((near & visible).avg() / visible.avg())
    return float(near.avg() / 255)


def test_facts_through_the_worker(file_env: Env) -> None:
    chosen = _photos()
    ids = file_env.ingest([path for path, _ in chosen])
    file_env.cli("run", "--drain")
    rows = {r["id"]: r for r in file_env.query("SELECT * FROM photos")}
    for photo_id, (path, expected) in zip(ids, chosen, strict=True):
        row = rows[photo_id]
        assert row["processing_state"] == "processed", (path.name, row["error_code"])
        for column, value in expected.items():
            got = json.loads(row[column]) if column == "exposure" and row[column] else row[column]
            assert got == value, (path.name, column)
        assert row["original_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert (row["latitude"], row["longitude"]) == (None, None)  # not kept by default
        renditions = json.loads(row["renditions"])
        thumb = _fetch(file_env, renditions[-1]["key"])
        hashed = base64.b64decode(row["thumbhash"])
        average = thumbhash.average_rgba(hashed)[:3]
        assert max(abs(a - b) for a, b in zip(average, _average(thumb), strict=True)) < 0.05, (
            path.name, average, _average(thumb))  # fmt: skip
        ratio = row["width"] / row["height"]
        assert abs(thumbhash.aspect_ratio(hashed) - ratio) / ratio < 0.2, path.name
        assert _share(thumb, row["dominant_color"]) > 0.1, (path.name, row["dominant_color"])
    dupes = file_env.query(
        "SELECT count(*) AS n FROM photos WHERE original_sha256 = $1",
        hashlib.sha256(chosen[0][0].read_bytes()).hexdigest(),
    )
    assert dupes == [{"n": 1}]


def test_location_only_when_kept(file_env: Env) -> None:
    ids = file_env.ingest([PHOTOS / "iphone_hdr_NO.jpg"])
    file_env.cli("run", "--drain", DARKROOM_KEEP_LOCATION="true")
    [row] = file_env.query("SELECT latitude, longitude, renditions FROM photos WHERE id = $1", *ids)
    assert (row["latitude"], row["longitude"]) == (
        pytest.approx(40.4469722),
        pytest.approx(-3.7247528),
    )
    for r in json.loads(row["renditions"]):
        assert b"GPS" not in _fetch(file_env, r["key"])


def test_hostile_exif_does_not_fail_the_photo(file_env: Env, tmp_path: Path) -> None:
    base = (PHOTOS / "Landscape_3.jpg").read_bytes()
    paths = []
    for name, block in hostile_blocks().items():
        path = tmp_path / f"{name}.jpg"
        path.write_bytes(with_exif(base, block))
        paths.append(path)
    ids = file_env.ingest(paths)
    file_env.cli("run", "--drain")
    rows = file_env.query(
        "SELECT processing_state, visibility, camera_make, taken_at_local, thumbhash"
        " FROM photos WHERE id = ANY($1::uuid[])", ids,
    )  # fmt: skip
    assert len(rows) == len(paths)
    for row in rows:
        assert (row["processing_state"], row["visibility"]) == ("processed", "published")
        assert (row["camera_make"], row["taken_at_local"]) == (None, None)
        assert row["thumbhash"]


# --- self-check -------------------------------------------------------------------------


def test_check_prints_a_table(file_env: Env) -> None:
    result = file_env.cli("check", DARKROOM_RENDITIONS="a:64:webp:80,b:64:avif:50,c:64:png")
    lines = result.stdout.splitlines()
    for name in ("decode jpeg", "decode png", "decode webp", "decode gif", "decode heic",
                 "decode avif", "encode webp", "encode avif", "encode png", "orientation",
                 "colour (CMYK → sRGB)"):  # fmt: skip
        assert any(line.startswith(name) and " ok " in line for line in lines), name


# The self-check runs where renders run, in a child of the render processes' forkserver:
# a module the forkserver preloads after the pipeline takes the loader away there.
NO_WEBP = """
import pyvips
from darkroom.image import pipeline  # configures libvips, then a loader goes missing
pyvips.operation_block_set("VipsForeignLoadWebp", True)
"""
BLOCKED_RUN = """
import sys
from darkroom.image import forking
forking.forkserver().set_forkserver_preload(["darkroom.image.renderproc", "no_webp"])
from darkroom.cli import main
sys.exit(main(["run", "--drain"]))
"""


def test_run_refuses_to_start_when_a_loader_is_missing(file_env: Env) -> None:
    (file_env.tmp / "no_webp.py").write_text(NO_WEBP)
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN],
        env=file_env.environ(),
        cwd=file_env.tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "self-check failed" in result.stderr and "decode webp" in result.stderr
    assert "decode jpeg" not in result.stderr  # only what is missing is named


# --- re-render --------------------------------------------------------------------------


def _row(env: Env, photo_id: uuid.UUID) -> dict[str, Any]:
    return env.query("SELECT * FROM photos WHERE id = $1", photo_id)[0]


def test_rerender_replaces_renditions_without_unpublishing(file_env: Env) -> None:
    [photo_id] = file_env.ingest([PHOTOS / "jpg-24bit-icc-adobe-rgb.jpg"])
    file_env.cli("run", "--drain")
    before = _row(file_env, photo_id)
    file_env.query("UPDATE photos SET thumbhash = NULL, camera_make = NULL WHERE id = $1", photo_id)
    new = "small:200:webp:70,big:800:avif:50:inline"
    out = file_env.cli("enqueue", "--rerender", str(photo_id)).stdout
    assert out.split()[0] == str(photo_id)
    worker = file_env.start("run", DARKROOM_RENDITIONS=new)
    deadline = time.monotonic() + 90
    seen = 0
    while (row := _row(file_env, photo_id))["rerendered_at"] is None:
        assert (row["processing_state"], row["visibility"]) == ("processed", "published")
        assert time.monotonic() < deadline, "not re-rendered"
        seen += 1
    worker.terminate()
    worker.communicate(timeout=60)
    assert seen > 0
    assert (row["processing_state"], row["visibility"]) == ("processed", "published")
    assert row["processed_at"] == before["processed_at"]
    assert row["rerendered_at"] > before["processed_at"]
    assert row["rerender_requested_at"] is None
    assert [(r["name"], r["format"]) for r in json.loads(row["renditions"])] == [
        ("big", "avif"), ("small", "webp")]  # fmt: skip
    assert row["camera_make"] == "Canon" and row["thumbhash"]  # facts written again
    averages = [thumbhash.average_rgba(base64.b64decode(r["thumbhash"])) for r in (row, before)]
    assert max(abs(a - b) for a, b in zip(*averages, strict=True)) < 0.03


def test_rerender_selects_processed_since_and_leaves_others(file_env: Env) -> None:
    ids = file_env.ingest([PHOTOS / "4.webp", PHOTOS / "Landscape_2.jpg"])
    file_env.cli("run", "--drain")
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    result = file_env.cli("enqueue", "--rerender", "--state", "processed", "--since", since)
    assert sorted(line.split()[0] for line in result.stdout.splitlines()) == sorted(map(str, ids))
    file_env.cli("run", "--drain")
    rows = file_env.query(
        "SELECT rerendered_at, visibility FROM photos WHERE id = ANY($1::uuid[])", ids
    )
    assert all(r["rerendered_at"] is not None and r["visibility"] == "published" for r in rows)
    missing = file_env.cli("enqueue", "--rerender", str(uuid.uuid4()), check=False)
    assert missing.returncode == 1 and "not processed" in missing.stderr
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    assert (
        file_env.cli("enqueue", "--rerender", "--state", "processed", "--since", future).stdout
        == ""
    )
    assert file_env.cli("enqueue", "--rerender", check=False).returncode == 2


# --- migrate ----------------------------------------------------------------------------

FACT_COLUMNS = ("taken_at_local", "taken_at", "camera_make", "camera_model", "lens_model",
                "exposure", "original_sha256", "has_alpha", "frames", "source_profile",
                "latitude", "longitude", "thumbhash", "dominant_color", "rerendered_at",
                "rerender_requested_at")  # fmt: skip


def test_migrate_adds_fact_columns_to_a_database_with_rows(file_env: Env) -> None:
    drop = ", ".join(f"DROP COLUMN {c}" for c in FACT_COLUMNS)
    file_env.query(f"ALTER TABLE photos {drop}")
    file_env.query("DROP TABLE darkroom_schema")  # a database from before the facts
    photo_id = uuid.uuid4()
    file_env.query("INSERT INTO photos (id, original_key) VALUES ($1, 'originals/x')", photo_id)
    file_env.cli("migrate")
    file_env.cli("migrate")
    sql = "SELECT column_name FROM information_schema.columns WHERE table_name = 'photos'"
    columns = {r["column_name"] for r in file_env.query(sql)}
    assert set(FACT_COLUMNS) <= columns
    indexes = file_env.query("SELECT indexname FROM pg_indexes WHERE tablename = 'photos'")
    assert {"indexname": "photos_original_sha256_idx"} in indexes
    assert [r["id"] for r in file_env.query("SELECT id FROM photos")] == [photo_id]


def test_failed_rerender_keeps_the_photo_published(file_env: Env) -> None:
    [photo_id] = file_env.ingest([PHOTOS / "Landscape_4.jpg"])
    file_env.cli("run", "--drain")
    before = _row(file_env, photo_id)
    (file_env.tmp / "var" / "storage" / before["original_key"]).unlink()
    file_env.cli("enqueue", "--rerender", str(photo_id))
    file_env.cli("run", "--drain")
    after = _row(file_env, photo_id)
    assert (after["processing_state"], after["visibility"]) == ("processed", "published")
    assert after["renditions"] == before["renditions"] and after["rerendered_at"] is None
    # answered by the failure (the job says how): not counted in flight, not claimable again
    assert after["rerender_requested_at"] is None
    assert file_env.redis.xlen(file_env.dead) == 0
    job = file_env.query("SELECT state, error_code FROM photo_jobs WHERE photo_id = $1", photo_id)
    assert (job[0]["state"], job[0]["error_code"]) == ("failed", "original_missing")


def test_rerender_that_keeps_failing_is_given_up(file_env: Env) -> None:
    """A re-render that keeps failing (here: over a tiny memory limit) is retried up to the
    cap, then given up: the photo keeps its renditions and stays published, no loop."""
    [photo_id] = file_env.ingest([PHOTOS / "iphone_13_pro_max.HEIC"])
    file_env.cli("run", "--drain")
    before = _row(file_env, photo_id)
    file_env.cli("enqueue", "--rerender", str(photo_id))
    file_env.cli("run", "--drain", DARKROOM_RENDER_MEMORY_MB="200", DARKROOM_MAX_ATTEMPTS="2",
                 DARKROOM_RETRY_BASE_MS="100")  # fmt: skip
    after = _row(file_env, photo_id)
    assert (after["processing_state"], after["visibility"]) == ("processed", "published")
    assert after["renditions"] == before["renditions"] and after["rerendered_at"] is None
    # answered by the failure (the job says how): not counted in flight, not claimable again
    assert after["rerender_requested_at"] is None
    assert file_env.redis.xlen(file_env.stream) == 0 and file_env.redis.xlen(file_env.dead) == 0
    jobs = file_env.query("SELECT attempt FROM photo_jobs WHERE photo_id = $1", photo_id)
    assert jobs == [{"attempt": 3}]  # the first render, then two re-render attempts
