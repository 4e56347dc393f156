"""Real cameras' RAW files through the worker, fetched by tests/fetch_samples.py into
.cache/samples. A Sony ILCE-7RM3 ARW (libraw-cffi's MIT-licensed test file, from PyPI): its
camera preview is 1616×1080, shorter than the default 2048 px rendition, so LibRaw decodes the
sensor; with renditions the preview covers, the preview serves. Either way: upright sRGB
renditions of the picture the camera saw, in its tones, and the camera's own facts. A Canon
EOS R6 CR3 (exiv2's test file, from Debian's archive) whose sensor data was pruned: LibRaw
cannot decode it, so its 1620×1080 preview serves, with the facts of its CMT boxes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pyvips

from darkroom.image import raw
from tests.conftest import Env

SAMPLES = Path(__file__).resolve().parent.parent / ".cache" / "samples"
ARW = "sony-ilce-7rm3.arw"
CR3 = "canon-eos-r6-pruned.cr3"


def _sample(name: str) -> Path:
    path = SAMPLES / name
    if not path.exists():
        pytest.fail(f"{path} is missing: `make samples` fetches it")
    return path


def _luma(image: pyvips.Image, width: int = 192) -> np.ndarray:
    """The picture's shape at `width` px, zero mean and unit variance: what orientation and
    content change, not tone."""
    small = image.thumbnail_image(width)
    grey = small.colourspace("b-w")[0].numpy().astype(np.float64)
    return (grey - grey.mean()) / (grey.std() or 1.0)


def _mean_luma(image: pyvips.Image) -> float:
    return float(image.colourspace("b-w")[0].avg())


def _likeness(a: pyvips.Image, b: pyvips.Image) -> float:
    """Correlation of two images' luma at the same small size."""
    x = _luma(a)
    y = _luma(b.thumbnail_image(x.shape[1], height=x.shape[0], size="force"))
    return float((x * y).mean())


def _camera_preview(data: bytes, kind: str = "arw") -> pyvips.Image:
    """The camera's own rendering of the frame, upright: the file's largest preview."""
    shown = raw.preview(data, kind, needed_edge=0, max_pixels=10**9, decoder=False)
    return pyvips.Image.new_from_buffer(shown.jpeg, "").autorot()


def _processed(
    env: Env, tmp_path: Path, sample: str = ARW, **extra: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The photo's row and its renditions by name, after one worker drained it."""
    original = tmp_path / "original.bin"  # the name says nothing of the format
    shutil.copy(_sample(sample), original)
    [photo_id] = env.ingest([original])
    env.cli("run", "--drain", timeout=600, **extra)
    [row] = env.query("SELECT * FROM photos WHERE id = $1", photo_id)
    assert row["processing_state"] == "processed", (row["error_code"], row["error_message"])
    return row, {r["name"]: r for r in json.loads(row["renditions"])}


def _stored(env: Env, rendition: dict[str, Any]) -> pyvips.Image:
    return pyvips.Image.new_from_file(str(env.tmp / "var" / "storage" / rendition["key"]))


def _the_cameras_facts(row: dict[str, Any]) -> None:
    assert row["format"] == "arw"
    assert (row["camera_make"], row["camera_model"]) == ("SONY", "ILCE-7RM3")
    assert str(row["taken_at_local"]).startswith("2018-07-11")
    assert row["lens_model"] and "55-210" in row["lens_model"]


def test_a_sony_arw_is_decoded_from_its_sensor_upright_and_as_the_camera_framed_it(
    file_env: Env, tmp_path: Path
) -> None:
    """Default renditions (2048 px): LibRaw's decode at half size, the sensor's size as the
    photo's, every rendition sRGB, upright and the camera's picture (its luma correlates
    with the camera's preview; turned or mirrored, it would not), in the camera's tones."""
    row, renditions = _processed(file_env, tmp_path)
    _the_cameras_facts(row)
    assert (row["width"], row["height"]) == (5184, 3464)
    assert (renditions["large"]["width"], renditions["large"]["height"]) == (2048, 1368)
    preview = _camera_preview(_sample(ARW).read_bytes())
    for name, rendition in renditions.items():
        image = _stored(file_env, rendition)
        assert image.interpretation == "srgb", name
        assert (image.width, image.height) == (rendition["width"], rendition["height"]), name
        assert _likeness(image, preview) > 0.95, name
        assert _likeness(image.flip("horizontal"), preview) < 0.7, name
        assert _likeness(image.flip("vertical"), preview) < 0.7, name
        # the camera's tones (image/tones.py): LibRaw's own rendering is a third darker (0.67)
        assert 0.85 < _mean_luma(image) / _mean_luma(preview) < 1.15, name


def test_a_sony_arw_whose_preview_covers_the_renditions_renders_from_it(
    file_env: Env, tmp_path: Path
) -> None:
    """Renditions of 1024 px at most: the camera's 1616 px preview serves, and the photo's size
    is the preview's; the same facts."""
    listed = "thumb:320:webp:80,medium:1024:jpeg:82"
    row, renditions = _processed(file_env, tmp_path, DARKROOM_RENDITIONS=listed)
    _the_cameras_facts(row)
    assert (row["width"], row["height"]) == (1616, 1080)
    preview = _camera_preview(_sample(ARW).read_bytes())
    medium = _stored(file_env, renditions["medium"])
    assert (medium.width, medium.height) == (1024, 684)
    assert medium.interpretation == "srgb"
    assert _likeness(medium, preview) > 0.98


def test_a_canon_cr3_without_sensor_data_renders_from_its_preview_with_its_facts(
    file_env: Env, tmp_path: Path
) -> None:
    """Default renditions: LibRaw refuses the pruned sensor data, the camera's 1620 px
    preview (at least raw.USABLE_EDGE) serves; make, model, lens, exposure and capture time
    (with its offset) from CMT1 and CMT2."""
    row, renditions = _processed(file_env, tmp_path, CR3)
    assert row["format"] == "cr3"
    assert (row["camera_make"], row["camera_model"]) == ("Canon", "Canon EOS R6")
    assert row["lens_model"] == "RF70-200mm F2.8 L IS USM"
    assert str(row["taken_at_local"]) == "2021-05-12 12:21:21.920000"
    assert (row["width"], row["height"]) == (1620, 1080)
    assert (renditions["large"]["width"], renditions["large"]["height"]) == (1620, 1080)
    preview = _camera_preview(_sample(CR3).read_bytes(), "cr3")
    for name, rendition in renditions.items():
        image = _stored(file_env, rendition)
        assert image.interpretation == "srgb", name
        assert _likeness(image, preview) > 0.95, name
        assert _likeness(image.flip("horizontal"), preview) < 0.7, name
