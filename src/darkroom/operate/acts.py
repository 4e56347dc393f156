"""The operator's state-changing commands: `dlq replay`, `enqueue` (and `--rerender`),
`retry` and `consumers prune` (with `dlq list`, which shares its command). Each one is
recorded in the audit trail (operate/audit.py): who, on which selection, how many, and how
it ended; the operations themselves are in operate/ops.py, shared with the page."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import msgspec

from darkroom import tracing
from darkroom.operate import audit
from darkroom.operate.ops import (
    NOT_FEEDABLE,
    Skipped,
    dead_letters,
    enqueue_again,
    prune_consumers,
    replay_letter,
    retry_photo,
)
from darkroom.operate.progress import Pacer, Progress
from darkroom.queue.messages import TRACE_FIELDS, Entry
from darkroom.queue.streams import Streams
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import db, publishing
from darkroom.store.audit import Action

REPLAY_FIELDS = ("photo_id", "error_code", "lane", *TRACE_FIELDS)


def _letter_line(letter: Entry) -> str:
    f = letter.fields
    return f"{letter.id}  {f.get('photo_id') or '-':<36}  {f.get('error_code', '?'):<20}"


def _ids(photo_ids: list[uuid.UUID]) -> list[str]:
    return [str(p) for p in photo_ids]


async def cmd_dlq(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, streams):
        if args.action == "list":
            return await _list_letters(streams, args)
        selection = {"codes": args.code, "limit": args.limit, "rate_per_s": args.rate}
        action = audit.cli_action(settings, "dlq.replay", selection, args.reason)
        return await audit.run_interruptible(lambda: _replay_letters(pool, streams, args, action))


async def _list_letters(streams: Streams, args: argparse.Namespace) -> int:
    letters = [e async for e in dead_letters(streams, args.code, args.limit or 1000)]
    if args.json:
        print(msgspec.json.encode([{"id": e.id, **e.fields} for e in letters]).decode())
        return 0
    for letter in letters:
        f = letter.fields
        print(f"{_letter_line(letter)}  attempts={f.get('attempts')}  {f.get('error', '')[:80]}")
    print(f"{len(letters)} dead letter(s)", file=sys.stderr)
    return 0


async def _replay_letters(
    pool: db.Pool, streams: Streams, args: argparse.Namespace, action: Action
) -> int:
    async with audit.audited(pool, action) as tally:
        # Only what a replay needs, so 100,000 letters stay a few tens of MB.
        letters = [Entry(e.id, {k: v for k, v in e.fields.items() if k in REPLAY_FIELDS})
                   async for e in dead_letters(streams, args.code, args.limit)]  # fmt: skip
        verb = "would replay" if args.dry_run else "replayed"
        progress, pacer = Progress(len(letters), verb, sys.stderr), Pacer(args.rate)
        tally.detail["skipped"] = 0
        if args.dry_run:
            tally.outcome = "dry_run"
        for letter in letters:
            await _replay_one(pool, streams, letter, args.dry_run, pacer, progress, tally)
        progress.finish(f"{tally.detail['skipped']} skipped" if tally.detail["skipped"] else "")
    return 0


async def _replay_one(
    pool: db.Pool, streams: Streams, letter: Entry, dry_run: bool, pacer: Pacer,
    progress: Progress, tally: audit.Tally,
) -> None:  # fmt: skip
    """One letter: counted in the trail as soon as it is replayed (or, on a dry run,
    would be), so an interrupted replay's row says how many went back."""
    if dry_run:
        progress.advance()
        tally.count += 1
        progress.line(f"{_letter_line(letter)}  would replay", sys.stdout)
        return
    await pacer.wait()
    new_id = await replay_letter(pool, streams, letter)
    if isinstance(new_id, Skipped):
        tally.detail["skipped"] += 1
        progress.line(f"{_letter_line(letter)}  skipped: {new_id.why}", sys.stdout)
        return
    tally.count += 1
    progress.advance()
    progress.line(f"{_letter_line(letter)}  replayed as {new_id}", sys.stdout)


async def cmd_enqueue(settings: Settings, args: argparse.Namespace) -> int:
    """Each photo into its own lane (or `--lane`); exits 1 if a bulk photo was not handed
    to the feeder (gone or finished: nothing was enqueued for it)."""
    selection = {"photo_ids": _ids(args.photo_ids), "lane": args.lane, "tenant": args.tenant}
    action = audit.cli_action(settings, "enqueue", selection, args.reason)
    async with services(settings, 1) as (pool, streams):
        await streams.ensure_group()
        return await audit.run_interruptible(lambda: _enqueue(pool, streams, args, action))


async def _enqueue(
    pool: db.Pool, streams: Streams, args: argparse.Namespace, action: Action
) -> int:
    async with audit.audited(pool, action, long=False) as tally:
        for photo_id in args.photo_ids:
            with tracing.producer("darkroom.enqueue", photo_id=str(photo_id)) as carried:
                sent = await enqueue_again(pool, streams, photo_id, args.lane, args.tenant, carried)
            if sent is None:
                print(f"{photo_id}: {NOT_FEEDABLE}", file=sys.stderr)
                tally.detail.setdefault("not_fed", []).append(str(photo_id))
            else:
                tally.count += 1
                print(sent, flush=True)
    return 1 if tally.detail else 0


async def cmd_retry(settings: Settings, args: argparse.Namespace) -> int:
    action = audit.cli_action(settings, "retry", {"photo_ids": _ids(args.photo_ids)}, args.reason)
    async with services(settings, 1) as (pool, streams):
        return await audit.run_interruptible(lambda: _retry(pool, streams, args, action))


async def _retry(pool: db.Pool, streams: Streams, args: argparse.Namespace, action: Action) -> int:
    """Refused in the trail when no photo was failed (nothing was retried)."""
    async with audit.audited(pool, action, long=False) as tally:
        for photo_id in args.photo_ids:
            entry_id = await retry_photo(pool, streams, photo_id)
            if entry_id is None:
                print(f"{photo_id} is not processing_failed; left alone", file=sys.stderr)
                tally.detail.setdefault("left_alone", []).append(str(photo_id))
            else:
                tally.count += 1
                print(photo_id, entry_id, flush=True)
        tally.outcome = "done" if tally.count else "refused"
    return 1 if tally.detail else 0


def _rerender_usage(args: argparse.Namespace) -> str | None:
    if not args.rerender or (args.state is None) != (args.since is None):
        return "use enqueue --rerender PHOTO_ID... and/or --state processed --since DATE"
    if not args.photo_ids and args.since is None:
        return "enqueue --rerender needs PHOTO_ID... or --since"
    return None


async def cmd_rerender(settings: Settings, args: argparse.Namespace) -> int:
    """Re-render processed photos in place (after DARKROOM_RENDITIONS changed or an
    upgrade): mark them, then XADD. They stay published throughout."""
    usage = _rerender_usage(args)
    if usage:
        print(f"darkroom: {usage}", file=sys.stderr)
        return 2
    selection: dict[str, Any] = {
        "photo_ids": _ids(args.photo_ids), "state": args.state, "since": args.since,
        "lane": args.lane, "tenant": args.tenant,
    }  # fmt: skip
    action = audit.cli_action(settings, "rerender", selection, args.reason)
    async with services(settings, 1) as (pool, streams):
        await streams.ensure_group()
        return await audit.run_interruptible(lambda: _rerender(pool, streams, args, action))


async def _rerender(
    pool: db.Pool, streams: Streams, args: argparse.Namespace, action: Action
) -> int:
    async with audit.audited(pool, action) as tally:
        marked = await publishing.request_rerender(pool, list(args.photo_ids), args.since)
        tally.detail["marked"] = len(marked)
        # a whole library goes through bulk unless told otherwise; named photos keep theirs
        lane = args.lane or ("bulk" if args.since else None)
        lost = 0
        for photo_id in marked:
            sent = await _enqueued(pool, streams, photo_id, lane, args.tenant)
            tally.count += sent
            lost += not sent
        left = sorted(set(args.photo_ids) - set(marked))
        for photo_id in left:
            print(f"{photo_id} is not processed; left alone", file=sys.stderr)
        tally.detail |= {"left_alone": len(left), "not_fed": lost}
    return 1 if left or lost else 0


async def _enqueued(
    pool: db.Pool, streams: Streams, photo_id: uuid.UUID, lane: str | None, tenant: str | None
) -> bool:
    """A marked photo re-rendered through its lane: `photo_id entry_id`, or why not."""
    sent = await enqueue_again(pool, streams, photo_id, lane, tenant)
    if sent is None:  # deleted since it was marked
        print(f"{photo_id}: {NOT_FEEDABLE}", file=sys.stderr)
        return False
    print(photo_id, sent, flush=True)
    return True


async def cmd_consumers(settings: Settings, args: argparse.Namespace) -> int:
    selection = {"idle_ms": args.idle}
    action = audit.cli_action(settings, "consumers.prune", selection, args.reason)
    async with (
        services(settings, 1) as (pool, streams),
        audit.audited(pool, action, long=False) as tally,
    ):
        names = await prune_consumers(streams, args.idle, args.dry_run)
        tally.count, tally.detail["consumers"] = len(names), names
        tally.outcome = "dry_run" if args.dry_run else "done"
    for name in names:
        print(f"{name}  {'would remove' if args.dry_run else 'removed'}")
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(names)} consumer(s) idle over {args.idle} ms", file=sys.stderr)
    return 0
