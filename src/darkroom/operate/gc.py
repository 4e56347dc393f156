"""`darkroom gc`: deletes the rendition objects no photo row references: uploads of a render
that never committed (a crash, a failed re-render) and old renditions whose delete after
a re-render failed. Objects younger than the grace period (an upload whose publish may not
have committed yet) and those of a photo being processed are never touched.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable

from darkroom.errors import ObjectForbiddenError
from darkroom.operate import audit
from darkroom.services import services, storage_for
from darkroom.settings import Settings
from darkroom.store import db, keys
from darkroom.store.audit import Action
from darkroom.store.storage import Page, Storage, StoredObject

# An upload is committed (or abandoned) well within this: the publish follows the last
# upload of its photo at once (a dependency outage in between makes the worker render and
# upload again), so a shorter grace could collect an upload about to be committed.
GRACE_S = 3600.0
MIN_GRACE_S = 300.0

Say = Callable[[str], None]


async def collect(
    pool: db.Pool, storage: Storage, *, older_than_s: float, now_s: float, dry_run: bool,
    say: Say,
) -> Counter[str]:  # fmt: skip
    """One pass over every rendition object, page by page: how many objects got each
    verdict (`deleted`, `referenced`, `young`, `busy`, `foreign`, `failed`)."""
    tally: Counter[str] = Counter()
    async for page in storage.list(keys.PREFIX):
        tally["listed"] += len(page)
        orphans = await _orphans(pool, page, older_than_s, now_s, tally)
        for photo_id, objects in orphans.items():
            if dry_run:
                tally["deleted"] += len(objects)
                for obj in objects:
                    say(_line("would delete", obj, now_s))
                continue
            await _collect_photo(pool, storage, photo_id, objects, (older_than_s, now_s), tally,
                                 say)  # fmt: skip
    return tally


async def _orphans(
    pool: db.Pool, page: Page, older_than_s: float, now_s: float, tally: Counter[str]
) -> dict[uuid.UUID, list[StoredObject]]:
    """A first look at one page, without locks: the orphans, by photo."""
    photos = {photo for obj in page if (photo := keys.photo_of(obj.key)) is not None}
    held = await db.held_photos(pool, sorted(photos))
    orphans: dict[uuid.UUID, list[StoredObject]] = defaultdict(list)
    for obj in page:
        photo = keys.photo_of(obj.key)
        seen = held.get(photo) if photo is not None else None
        found = keys.verdict(obj.modified_s, now_s, older_than_s, obj.key, seen)
        if found == "orphan" and photo is not None:
            orphans[photo].append(obj)
        else:
            tally[found] += 1
    return orphans


async def _collect_photo(
    pool: db.Pool, storage: Storage, photo_id: uuid.UUID, objects: list[StoredObject],
    clock: tuple[float, float], tally: Counter[str], say: Say,
) -> None:  # fmt: skip
    """Decided again under the photo's and its job's row locks, so no claim or publish of
    the photo runs between the decision and the delete, on each object's write time read
    afresh: the listing's may predate a same-key upload made since (a key names its
    content, so a render of the same bytes writes it again)."""
    older_than_s, now_s = clock
    async with db.hold_photo(pool, photo_id) as held:
        for listed in objects:
            obj = await storage.stat(listed.key)
            if obj is None:
                tally["gone"] += 1
                continue
            found = keys.verdict(obj.modified_s, now_s, older_than_s, obj.key, held)
            if found != "orphan":
                tally[found] += 1
                continue
            try:
                await storage.delete(obj.key)
            except ObjectForbiddenError as exc:  # this object alone: report it, go on
                tally["failed"] += 1
                say(f"not deleted  {obj.key}  {exc.code}: {exc}")
                continue
            tally["deleted"] += 1
            say(_line("deleted", obj, now_s))


def _line(verb: str, obj: StoredObject, now_s: float) -> str:
    age_h = (now_s - obj.modified_s) / 3600
    return f"{verb}  {obj.key}  {obj.size} bytes  {age_h:.1f} h old"


def summary(tally: Counter[str], older_than_s: float, dry_run: bool) -> str:
    verb = "would delete" if dry_run else "deleted"
    kept = (f"{tally['referenced']} referenced, {tally['young']} younger than "
            f"{older_than_s:g} s, {tally['busy']} of photos being processed, "
            f"{tally['foreign']} not rendition keys")  # fmt: skip
    failed = f"; {tally['failed']} could not be deleted" if tally["failed"] else ""
    gone = f"; {tally['gone']} gone since listed" if tally["gone"] else ""
    return (f"{verb} {tally['deleted']} of {tally['listed']} rendition objects; "
            f"kept {kept}{failed}{gone}")  # fmt: skip


async def cmd_gc(settings: Settings, args: argparse.Namespace) -> int:
    selection = {"older_than_s": args.older_than, "dry_run": args.dry_run}
    action = audit.cli_action(settings, "gc", selection, args.reason)
    async with services(settings, 2) as (pool, _), storage_for(settings) as storage:
        tally = await audit.until_signalled(lambda: _collect(pool, storage, args, action))
    if tally is None:
        return audit.INTERRUPTED_EXIT
    print(summary(tally, args.older_than, args.dry_run), file=sys.stderr)
    return 1 if tally["failed"] else 0


async def _collect(
    pool: db.Pool, storage: Storage, args: argparse.Namespace, action: Action
) -> Counter[str]:
    """One pass, in the trail: how many objects were deleted (or would be), and why the
    rest were kept."""
    async with audit.audited(pool, action) as row:
        tally = await collect(
            pool, storage, older_than_s=args.older_than, now_s=time.time(),
            dry_run=args.dry_run, say=lambda line: print(line, flush=True),
        )  # fmt: skip
        row.count, row.detail = tally["deleted"], dict(tally)
        row.outcome = "dry_run" if args.dry_run else "done"
    return tally
