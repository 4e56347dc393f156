"""Operator commands: status, photos, dead letters (list/replay) and retry."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import msgspec

from darkroom import db
from darkroom.messages import task_fields
from darkroom.services import services
from darkroom.settings import Settings


async def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, streams):
        report = {**await streams.status(), "photos": await db.count_by_state(pool)}
        report["failures"] = await db.count_failures(pool)
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(_format_status(report))
    return 0


def _format_status(report: dict[str, Any]) -> str:
    lines = [
        f"stream        {report['stream']}  length={report['length']}",
        f"group         {report['group']}  lag={report['lag']}  pending={report['pending']}",
        f"dead letters  {report['dead_letter_stream']}  length={report['dead_letters']}",
        "consumers",
        *(f"  {c['name']:<40} pending={c['pending']:<6} idle_ms={c['idle_ms']}"
          for c in report["consumers"]),
        "photos by state",
        *(f"  {state:<20} {n}" for state, n in report["photos"].items()),
        "failures by error code",
        *(f"  {code:<20} {n}" for code, n in report["failures"].items()),
    ]  # fmt: skip
    return "\n".join(lines)


async def cmd_photos(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, _):
        rows = await db.list_photos(pool, args.state, args.limit)
    if args.json:
        print(msgspec.json.encode(rows).decode())
        return 0
    header = f"{'photo_id':<36}  {'state':<17}  {'format':<6}  {'size':>11}  {'bytes':>9}  "
    print(header + "renditions  attempt  error_code")
    for r in rows:
        size = f"{r['width']}x{r['height']}" if r["width"] else "-"
        print(f"{r['id']!s:<36}  {r['processing_state']:<17}  {r['format'] or '-':<6}  "
              f"{size:>11}  {r['bytes'] or 0:>9}  {r['renditions']:>10}  {r['attempt']:>7}  "
              f"{r['error_code'] or ''}")  # fmt: skip
    return 0


async def cmd_dlq(settings: Settings, args: argparse.Namespace) -> int:
    """List dead letters, or replay them: the photo is reset to `uploaded` in Postgres, then
    the letter is moved back onto the work stream in one Lua script (so never twice)."""
    async with services(settings, 1) as (pool, streams):
        letters = [
            e for e in await streams.dead_letters(args.limit)
            if not args.code or e.fields.get("error_code") in args.code
        ]  # fmt: skip
        for letter in letters:
            f = letter.fields
            line = f"{letter.id}  {f.get('photo_id') or '-':<36}  {f.get('error_code', '?'):<20}"
            if args.action == "list":
                print(f"{line}  attempts={f.get('attempts')}  {f.get('error', '')[:80]}")
            elif not f.get("photo_id"):
                print(f"{line}  not replayable (no photo_id)")
            elif args.dry_run:
                print(f"{line}  would replay")
            else:
                photo_id = uuid.UUID(f["photo_id"])
                await db.reset_failed(pool, photo_id)
                new_id = await streams.replay(letter.id, task_fields(photo_id))
                await db.record_requeued(pool, photo_id, new_id)
                print(f"{line}  replayed as {new_id}")
    print(f"{len(letters)} dead letter(s)", file=sys.stderr)
    return 0


async def cmd_retry(settings: Settings, args: argparse.Namespace) -> int:
    """A failed photo is terminal until an operator retries it: reset, then XADD."""
    status = 0
    async with services(settings, 1) as (pool, streams):
        await streams.ensure_group()
        for photo_id in args.photo_ids:
            if await db.reset_failed(pool, photo_id):
                entry_id = await streams.enqueue(task_fields(photo_id))
                await db.record_requeued(pool, photo_id, entry_id)
                print(photo_id, entry_id, flush=True)
            else:
                print(f"{photo_id} is not processing_failed; left alone", file=sys.stderr)
                status = 1
    return status


async def cmd_rerender(settings: Settings, args: argparse.Namespace) -> int:
    """Re-render processed photos in place (after DARKROOM_RENDITIONS changed or an
    upgrade): mark them, then XADD. They stay published throughout."""
    if not args.rerender or (args.state is None) != (args.since is None):
        print("darkroom: use enqueue --rerender PHOTO_ID... and/or --state processed --since "
              "DATE", file=sys.stderr)  # fmt: skip
        return 2
    if not args.photo_ids and args.since is None:
        print("darkroom: enqueue --rerender needs PHOTO_ID... or --since", file=sys.stderr)
        return 2
    async with services(settings, 1) as (pool, streams):
        await streams.ensure_group()
        marked = await db.request_rerender(pool, list(args.photo_ids), args.since)
        for photo_id in marked:
            entry_id = await streams.enqueue(task_fields(photo_id))
            await db.record_requeued(pool, photo_id, entry_id)
            print(photo_id, entry_id, flush=True)
    left = sorted(set(args.photo_ids) - set(marked))
    for photo_id in left:
        print(f"{photo_id} is not processed; left alone", file=sys.stderr)
    return 1 if left else 0
