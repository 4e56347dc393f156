"""The storage side of an erase: every object under a photo's renditions folder (every
generation, and a render's uploads still in flight) listed after the row's commit, its
original with `--original`, and their deletes; for `darkroom erase ID...` and, as the
hand-over after each photo's commit, for a bulk erase by query.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from darkroom.errors import DarkroomError
from darkroom.services import storage_for
from darkroom.settings import Settings
from darkroom.store import erasure, keys
from darkroom.store.db import Pool
from darkroom.store.storage import Storage

Say = Callable[[str], None]


async def objects(storage: Storage, photo_id: uuid.UUID, original: str | None) -> list[str]:
    """Every object under the photo's renditions folder (listed now: after the erase's
    commit, so no publish can add one it misses), and `original` when named."""
    listed = [obj.key async for page in storage.list(f"{keys.PREFIX}{photo_id}/") for obj in page]
    return listed + ([original] if original else [])


async def delete(
    storage: Storage, found: list[str], tally: Counter[str], say: Say, *, each: bool = True
) -> list[str]:
    """Delete each key; those that could not be (each tried: a rerun tries them again).
    `each`: say every deleted key, not only those left."""
    left = []
    for key in found:
        try:
            await storage.delete(key)
        except DarkroomError as exc:
            say(f"not deleted  {key}  {exc.code}: {exc}")
            tally["failed"] += 1
            left.append(key)
            continue
        if each:
            say(f"deleted  {key}")
        tally["deleted"] += 1
    return left


@dataclass
class Deleter:
    """A bulk erase's hand-over: after the commit that erased the photo, delete its
    objects; True once none is left (its item is then `sent`; else it stays `acted` and a
    rerun of the action deletes what is left)."""

    pool: Pool
    storage: Storage
    original: bool
    tally: Counter[str]
    say: Say

    async def __call__(self, photo_id: uuid.UUID) -> bool:
        key = await erasure.original_key(self.pool, photo_id) if self.original else None
        found, counted = await objects(self.storage, photo_id, key), Counter[str]()
        left = await delete(self.storage, found, counted, self.say, each=False)
        self.tally.update({f"objects_{name}": n for name, n in counted.items()})
        return not left


@asynccontextmanager
async def deleter(
    settings: Settings, pool: Pool, original: bool, tally: Counter[str], say: Say
) -> AsyncIterator[Deleter]:
    """A Deleter on the configured storage, open for the run."""
    async with storage_for(settings) as storage:
        yield Deleter(pool, storage, original, tally, say)
