"""`darkroom erase PHOTO_ID... --reason TEXT [--original] [--dry-run]`: a person's request to
be forgotten. Each photo's row is made `erased` first (facts nulled, lease revoked, event and
audit row in the same commit), then every object under its renditions folder (every
generation, and a render's uploads still in flight) is deleted, and its original with it.
`darkroom erase --tenant ... (the filters of select)` is `darkroom bulk erase`: paced,
resumable, one action over the frozen selection (operate/bulk.py).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections import Counter
from collections.abc import Callable

from msgspec.structs import replace

from darkroom.operate import bulk_commands, erasing
from darkroom.operate.audit import cli_action
from darkroom.services import services, storage_for
from darkroom.settings import Settings
from darkroom.store import audit, erasure
from darkroom.store.db import Pool
from darkroom.store.storage import Storage

# One transaction (and one audit row) per batch: a long list never holds thousands of row
# locks while claims of other photos wait behind one of them.
BATCH = 500

Say = Callable[[str], None]

HELP = (
    "erase photos, by id or by the filters of `select`: delete their renditions (and "
    "original), null what identifies a person or place; a render in flight is refused",
    'darkroom erase 0b5c4e2a-6d3f-4c1e-9a57-2f1d8e6b9c30 --original --reason "GDPR request 4411"'
    '\n  darkroom erase --tenant acme --original --reason "account closed" --rate 50/s',
)


def add_arguments(erase: argparse.ArgumentParser) -> None:
    erase.add_argument("photo_ids", nargs="*", type=uuid.UUID, metavar="PHOTO_ID")
    erase.add_argument("--reason", required=True, help="why (kept in the audit trail)")
    erase.add_argument("--original", action="store_true", help="delete the original too")
    erase.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    bulk_commands.filter_arguments(erase)
    bulk_commands.run_arguments(erase)
    erase.set_defaults(verb="erase", to_lane=None, to_tenant=None)


async def erase_photos(
    pool: Pool, storage: Storage, photo_ids: list[uuid.UUID], action: audit.Action, *,
    original: bool, dry_run: bool, say: Say,
) -> Counter[str]:  # fmt: skip
    """Erase these photos, batch by batch: each batch's rows commit first (from then on no
    render of them can publish), then their objects go. A render that uploads after the
    listing has its publish refused and deletes its own uploads; one that dies first
    leaves them to `darkroom gc`. Counts: erased, already, missing, deleted, failed."""
    tally: Counter[str] = Counter()
    unique = sorted(set(photo_ids))
    for start in range(0, len(unique), BATCH):
        batch = unique[start : start + BATCH]
        # each batch an action of the trail (its `started` commits with its rows)
        batch_action = action if start == 0 else replace(action, action_id=uuid.uuid4())
        found = await erasure.erase(pool, batch, batch_action, dry_run)
        _count(found, tally, say)
        left: list[str] = []
        for photo_id in found.found:
            key = found.originals[photo_id] if original else None
            listed = await erasing.objects(storage, photo_id, key)
            left += await _delete(storage, listed, dry_run, tally, say)
        if not dry_run:
            detail = {**found.detail(), "left": left}
            ending: audit.Outcome = "failed" if left else "done"
            await audit.record(pool, batch_action, ending, len(found.erased), detail)
    return tally


LABELS = {"erased": "erased", "already": "already erased", "missing": "not found"}


def _count(found: erasure.Erased, tally: Counter[str], say: Say) -> None:
    for name, label in LABELS.items():
        ids = getattr(found, name)
        tally[name] += len(ids)
        for photo_id in ids:
            say(f"{label}  {photo_id}")


async def _delete(
    storage: Storage, listed: list[str], dry_run: bool, tally: Counter[str], say: Say
) -> list[str]:
    if not dry_run:
        return await erasing.delete(storage, listed, tally, say)
    for key in listed:
        say(f"would delete  {key}")
    tally["deleted"] += len(listed)
    return []


def summary(tally: Counter[str], dry_run: bool) -> str:
    verb = "would erase" if dry_run else "erased"
    failed = (f"; {tally['failed']} could not be deleted: run the same erase again"
              if tally["failed"] else "")  # fmt: skip
    return (f"{verb} {tally['erased']} photo(s) ({tally['already']} already erased, "
            f"{tally['missing']} not found); {'would delete' if dry_run else 'deleted'} "
            f"{tally['deleted']} object(s){failed}")  # fmt: skip


async def cmd_erase(settings: Settings, args: argparse.Namespace) -> int:
    """By id, or (no id) by the selection's filters as `darkroom bulk erase`."""
    where = bulk_commands.selection_of(args)
    if bool(args.photo_ids) == (not where.empty() or args.resume is not None):
        print("darkroom: erase takes PHOTO_ID... or a selection (--tenant, --state, ...), "
              "one of them", file=sys.stderr)  # fmt: skip
        return 2
    if not args.photo_ids:
        return await bulk_commands.cmd_bulk(settings, args)
    selection = {"photo_ids": sorted(set(args.photo_ids)), "original": args.original}
    action = cli_action(settings, "erase", selection, args.reason)
    async with services(settings, 2) as (pool, _), storage_for(settings) as storage:
        tally = await erase_photos(
            pool, storage, args.photo_ids, action, original=args.original,
            dry_run=args.dry_run, say=lambda line: print(line, flush=True),
        )  # fmt: skip
    print(summary(tally, args.dry_run), file=sys.stderr)
    return 1 if tally["failed"] else 0
