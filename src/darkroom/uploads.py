"""A render's renditions on their way to storage: each uploaded under a new key named by its
content (a half-done upload changes nothing a reader sees), listed as the photo's row lists
them, and the keys nobody references any more deleted once a commit (or a refusal) says so.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import structlog

from darkroom.errors import DarkroomError
from darkroom.image.results import Rendered, RenderResult
from darkroom.store import db, keys
from darkroom.store.storage import CONTENT_TYPES, Storage, Upload

log = structlog.get_logger("darkroom.jobs")


@dataclass
class Renditions:
    pool: db.Pool
    storage: Storage
    cache_control: str

    async def upload(self, photo_id: uuid.UUID, result: RenderResult) -> list[dict[str, Any]]:
        """Each rendition under a new key named by its content, beside the live ones: a
        half-done upload changes nothing a reader sees (the row still names the old keys)."""
        uploads = [upload_of(photo_id, r) for r in result.renditions]
        await self.storage.put_many(uploads, self.cache_control)
        return [described(r, u.key) for r, u in zip(result.renditions, uploads, strict=True)]

    async def delete_unreferenced(
        self, photo_id: uuid.UUID, candidates: list[str], what: str
    ) -> None:
        """After the commit (the replaced renditions), or after a refused publish (this
        delivery's uploads: an erase revoked the lease, or another delivery won), best
        effort: a failure only leaves objects for `darkroom gc`. Under the photo's row lock:
        no other delivery can claim it and commit these keys meanwhile, and none of a photo
        another delivery is rendering (its uploads may share these content-named keys)."""
        if not candidates:
            return
        try:
            async with db.hold_photo(self.pool, photo_id) as held:
                for key in keys.deletable(candidates, held):
                    await self.storage.delete(key)
        except DarkroomError as exc:
            log.warning(f"{what} left for darkroom gc", photo_id=str(photo_id),
                        keys=candidates, error_code=exc.code, error=str(exc))  # fmt: skip


def upload_of(photo_id: uuid.UUID, r: Rendered) -> Upload:
    key = keys.rendition_key(photo_id, r.name, r.ext, r.sha256)
    return Upload(key, r.data, CONTENT_TYPES[r.format])


def described(r: Rendered, key: str) -> dict[str, Any]:
    """The rendition as the photo's row lists it; a box's `crop` when it was cropped; the
    quality chosen for a target and the score its calibrated metric predicted
    (`scored_by`: not SSIMULACRA2 itself, see docs/photos.md)."""
    listed = {"name": r.name, "format": r.format, "type": CONTENT_TYPES[r.format],
                 "key": key, "width": r.width, "height": r.height,
                 "bytes": len(r.data)}  # fmt: skip
    if r.crop:
        listed["crop"] = r.crop
    if r.score is not None:
        listed |= {"quality": r.quality, "score": r.score, "scored_by": "ssim-calibrated"}
    return listed
