"""End to end through the real CLI: ingest → run --drain → published photos in storage."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pyvips

from tests.conftest import PHOTOS, Env, s3_client
from tests.imagecheck import mean_abs_diff, metadata_leaks, sniff

EXPECTED = [("thumb", "webp", 320), ("medium", "webp", 1024), ("medium", "jpeg", 1024),
            ("large", "webp", 2048)]  # fmt: skip
ALL_PHOTOS = sorted(p for p in PHOTOS.iterdir() if p.suffix.lower() != ".md")
UPRIGHT = {p.name: (1800, 1200) for p in PHOTOS.glob("Landscape_*.jpg")} | {
    "iphone_13_pro_max.HEIC": (3024, 4032),
    "avif-orientation-6.avif": (3024, 4032),
    "iphone_hdr_NO.jpg": (3264, 2448),
    "png-alpha-64bit.png": (1350, 600),
}

Fetch = Callable[[str], bytes]


def photos_by_id(env: Env, ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, object]]:
    rows = env.query("SELECT * FROM photos WHERE id = ANY($1::uuid[])", ids)
    return {row["id"]: row for row in rows}


def last_error(env: Env, photo_id: uuid.UUID) -> str | None:
    rows = env.query("SELECT last_error FROM photo_jobs WHERE photo_id = $1", photo_id)
    return rows[0]["last_error"] if rows else None


def check_published(
    env: Env, ids: list[uuid.UUID], paths: list[Path], fetch: Fetch
) -> dict[str, dict[str, bytes]]:
    """Every photo processed, published, with all four renditions right; returns files."""
    rows = photos_by_id(env, ids)
    files: dict[str, dict[str, bytes]] = {}
    for photo_id, path in zip(ids, paths, strict=True):
        row = rows[photo_id]
        state = (row["processing_state"], row["visibility"])
        assert state == ("processed", "published"), (
            path.name,
            row["error_code"],
            last_error(env, photo_id),
        )
        assert row["processed_at"] is not None and row["error_code"] is None
        assert row["bytes"] == path.stat().st_size
        if path.name in UPRIGHT:
            assert (row["width"], row["height"]) == UPRIGHT[path.name], path.name
        renditions = json.loads(row["renditions"])
        assert [(r["name"], r["format"]) for r in renditions] == [
            (n, f) for n, f, _ in sorted(EXPECTED, key=lambda e: -e[2])
        ]
        files[path.name] = {}
        for r, (_, _, size) in zip(renditions, sorted(EXPECTED, key=lambda e: -e[2]), strict=True):
            ext = "jpg" if r["format"] == "jpeg" else r["format"]
            data = fetch(r["key"])
            digest = hashlib.sha256(data).hexdigest()[:12]
            assert r["key"] == f"renditions/{photo_id}/{r['name']}-{digest}.{ext}"
            assert len(data) == r["bytes"] and sniff(data) == r["format"]
            image = pyvips.Image.new_from_buffer(data, "")
            assert (image.width, image.height) == (r["width"], r["height"])
            assert max(image.width, image.height) == min(size, max(row["width"], row["height"]))
            assert metadata_leaks(data) == [], (path.name, r["name"])
            files[path.name][f"{r['name']}.{ext}"] = data
    jobs = env.query("SELECT state, attempt FROM photo_jobs WHERE photo_id = ANY($1::uuid[])", ids)
    assert sorted(j["state"] for j in jobs) == ["done"] * len(ids)
    return files


def check_stream_empty(env: Env) -> None:
    assert env.redis.xlen(env.stream) == 0, "acked entries are deleted: only the backlog stays"
    assert env.redis.xpending(env.stream, "darkroom")["pending"] == 0


def check_landscapes_alike(files: dict[str, dict[str, bytes]]) -> None:
    reference = files["Landscape_1.jpg"]["thumb.webp"]
    for n in range(2, 9):
        assert mean_abs_diff(reference, files[f"Landscape_{n}.jpg"]["thumb.webp"]) < 12, n
    flipped = pyvips.Image.new_from_buffer(reference, "").flipver().webpsave_buffer()
    assert mean_abs_diff(reference, flipped) > 30, "the likeness check must be able to fail"


def test_s3_end_to_end_publishes_every_format(s3_env: Env) -> None:
    """JPEG/PNG/WebP/GIF/HEIC/AVIF through S3: published, upright, sized, metadata-free."""
    ids = s3_env.ingest(ALL_PHOTOS)
    assert len(ids) == len(ALL_PHOTOS) == len(set(ids))
    s3_env.cli("run", "--drain")
    bucket = s3_env.vars["DARKROOM_STORAGE_URL"].removeprefix("s3://").split("/")[0]
    client = s3_client(s3_env.vars["DARKROOM_S3_ENDPOINT_URL"])

    def fetch(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=f"photos/{key}")["Body"].read()

    files = check_published(s3_env, ids, ALL_PHOTOS, fetch)
    check_landscapes_alike(files)
    check_stream_empty(s3_env)
    [row] = s3_env.query("SELECT renditions FROM photos WHERE id = $1", ids[0])
    for r in json.loads(row["renditions"]):
        head = client.head_object(Bucket=bucket, Key=f"photos/{r['key']}")
        assert head["ContentType"] == {"webp": "image/webp", "jpeg": "image/jpeg"}[r["format"]]
        assert head["CacheControl"] == "public, max-age=31536000, immutable"


def test_local_folder_end_to_end(file_env: Env) -> None:
    """The embedded default (file:./var/storage) publishes the same way."""
    paths = [p for p in ALL_PHOTOS if p.suffix.lower() in (".jpg", ".heic", ".png", ".webp")][:10]
    ids = file_env.ingest(paths)
    file_env.cli("run", "--drain")
    root = file_env.tmp / "var" / "storage"
    check_published(file_env, ids, paths, lambda key: (root / key).read_bytes())
    check_stream_empty(file_env)
    assert not list(root.rglob("*.tmp")), "no temporary files left behind"


def test_second_run_is_already_and_uploads_nothing(file_env: Env) -> None:
    """Re-enqueued processed photos end `already`: no re-render, no re-upload, same processed_at."""
    paths = [PHOTOS / "Landscape_3.jpg", PHOTOS / "4.webp"]
    ids = file_env.ingest(paths)
    file_env.cli("run", "--drain")
    root = file_env.tmp / "var" / "storage" / "renditions"
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    first = photos_by_id(file_env, ids)
    file_env.cli("enqueue", *map(str, ids))
    log = file_env.cli("run", "--drain").stderr
    outcomes = [
        json.loads(line).get("outcome") for line in log.splitlines() if '"entry done"' in line
    ]
    assert outcomes == ["already", "already"]
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before
    second = photos_by_id(file_env, ids)
    assert [second[i]["processed_at"] for i in ids] == [first[i]["processed_at"] for i in ids]
    jobs = file_env.query(
        "SELECT state, attempt FROM photo_jobs WHERE photo_id = ANY($1::uuid[])", ids
    )
    assert [(j["state"], j["attempt"]) for j in jobs] == [("done", 1), ("done", 1)]
    check_stream_empty(file_env)


def test_unknown_photo_is_skipped_and_acked(file_env: Env) -> None:
    """An entry for a photo with no row ends `skipped`, acked, with no job row invented."""
    stranger = uuid.uuid4()
    file_env.cli("enqueue", str(stranger))
    log = file_env.cli("run", "--drain").stderr
    assert '"outcome": "skipped"' in log
    assert file_env.query("SELECT * FROM photo_jobs WHERE photo_id = $1", stranger) == []
    check_stream_empty(file_env)
    assert file_env.redis.xlen(file_env.dead) == 0
