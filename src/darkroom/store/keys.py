"""Pure: the rendition key scheme and which rendition objects may be deleted.

A rendition's key names its content (`renditions/<photo_id>/<name>-<hash12>.<ext>`), so
the bytes under a key never change: a re-render writes new keys beside the live ones and
the publishing commit switches the row to them. Only keys no row references may go.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

PREFIX = "renditions/"
HASH_CHARS = 12  # 48 bits of the sha256: keys differ whenever one photo's bytes do


def rendition_key(photo_id: uuid.UUID, name: str, ext: str, sha256_hex: str) -> str:
    return f"{PREFIX}{photo_id}/{name}-{sha256_hex[:HASH_CHARS]}.{ext}"


def photo_of(key: str) -> uuid.UUID | None:
    """The photo a rendition object belongs to; None for a key of another shape."""
    folder, _, rest = key.removeprefix(PREFIX).partition("/")
    if not key.startswith(PREFIX) or not rest or "/" in rest:
        return None
    try:
        return uuid.UUID(folder)
    except ValueError:
        return None


def keys_of(renditions_json: str | None) -> list[str]:
    """The keys a `photos.renditions` value references (none for NULL)."""
    items = msgspec.json.decode(renditions_json) if renditions_json else []
    return [str(item["key"]) for item in items]


def superseded(replaced: Iterable[str], current: Iterable[str]) -> list[str]:
    """Keys the previous row referenced and the new one does not (a re-render with the
    same bytes keeps its keys: nothing to delete)."""
    kept = set(current)
    return sorted({key for key in replaced if key not in kept})


@dataclass(frozen=True)
class Held:
    """A photo as read under its row lock: the keys its row references, and whether a
    delivery is working on it (its job is active: its uploads may not be committed yet)."""

    keys: frozenset[str]
    busy: bool


def deletable(candidates: Iterable[str], held: Held | None) -> list[str]:
    """Of these keys, those that may be deleted while the photo's row is locked: none of
    a photo being processed, none its row references; all of a photo whose row is gone."""
    if held is not None and held.busy:
        return []
    referenced = held.keys if held is not None else frozenset()
    return sorted(key for key in set(candidates) if key not in referenced)


def verdict(
    modified_s: float, now_s: float, older_than_s: float, key: str, held: Held | None
) -> str:
    """What `darkroom gc` does with one listed object: `orphan` (delete it), or why it
    stays: `referenced`, `busy` (its photo is being processed), `young` (written less than
    `older_than_s` ago: maybe an upload whose publish has not committed yet), `foreign`
    (not a rendition key)."""
    if photo_of(key) is None:
        return "foreign"
    if held is not None and key in held.keys:
        return "referenced"
    if now_s - modified_s < older_than_s:
        return "young"
    return "busy" if held is not None and held.busy else "orphan"
