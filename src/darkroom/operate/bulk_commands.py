"""The command line of bulk actions: `darkroom select` (an exact count and a sample) and
`darkroom bulk retry|rerender|move|erase` (a dry run, or a run that stops at SIGINT/SIGTERM
with `interrupted` and continues when run again), the selection's filters as flags (shared
with `darkroom erase`), and the run's summary and exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import uuid
from datetime import UTC, datetime

import anyio
import msgspec

from darkroom.operate import audit as audit_command
from darkroom.operate import bulk, erasing
from darkroom.operate.bulk import BATCH, VERBS, Plan, Run, action_name, plan_of
from darkroom.operate.progress import Progress, parse_rate
from darkroom.queue.lanes import parse_lane, parse_tenant
from darkroom.queue.streams import Streams
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import db, selection, views
from darkroom.store.selection import Selection

INTERRUPTED = 130


async def cmd_select(settings: Settings, args: argparse.Namespace) -> int:
    where = selection_of(args)
    async with services(settings, 1) as (pool, _):
        total = await selection.count(pool, where)
        ids = await selection.sample(pool, where, args.sample) if args.sample else []
    if args.json:
        print(msgspec.json.encode({"count": total, "sample": ids}).decode())
        return 0
    for photo_id in ids:
        print(photo_id)
    if args.count:
        print(total)
    else:
        print(f"{total} photo(s) match", file=sys.stderr)
    return 0


async def cmd_bulk(settings: Settings, args: argparse.Namespace) -> int:
    plan = await _plan(settings, args)
    if isinstance(plan, str):
        print(f"darkroom: {plan}", file=sys.stderr)
        return 2
    action = audit_command.cli_action(settings, action_name(plan.verb), plan.frozen(), args.reason)
    if args.resume:
        action = msgspec.structs.replace(action, action_id=args.resume)
    run = Run(action, plan, args.rate, args.batch, out=sys.stdout, resuming=bool(args.resume))
    async with services(settings, 2) as (pool, streams):
        if args.dry_run:
            total, ids = await bulk.dry_run(pool, run, args.sample)
            for photo_id in ids:
                print(f"{photo_id}  would be {VERBS[plan.verb]}")
            print(f"would act on {total} photo(s) (dry run: nothing changed)", file=sys.stderr)
            return 0
        if plan.verb != "erase":
            return await _run_until_signalled(pool, streams, run)
        async with erasing.deleter(settings, pool, plan.original, run.tally, _warn) as deleter:
            run.deliver = deleter
            return await _run_until_signalled(pool, streams, run)


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _run_until_signalled(pool: db.Pool, streams: Streams, run: Run) -> int:
    stop = anyio.Event()
    run.stopped = stop.is_set
    await streams.ensure_group()
    total, resumed = await bulk.begin(pool, run)
    action_id = run.action.action_id
    print(f"action {action_id}: {total} photo(s) selected{' (resumed)' if resumed else ''}; "
          f"rerun the same command, or `--resume {action_id}`, to continue after a stop",
          file=sys.stderr)  # fmt: skip
    progress = Progress(total, VERBS[run.plan.verb], sys.stderr)
    progress.done = total - (await selection.tally(pool, action_id)).get("pending", 0)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop)
            complete = await bulk.execute(pool, streams, run, progress)
            tg.cancel_scope.cancel()
    except Exception:
        # `interrupted`, never `failed`: a rerun must continue this action, not freeze anew
        with contextlib.suppress(Exception):  # the database may be what failed
            await bulk.finish(pool, run, False)
        raise
    counts = await bulk.finish(pool, run, complete)
    said = {**counts, **run.tally}
    progress.finish(", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(said.items())))
    if complete or stop.is_set():
        return 0 if complete else INTERRUPTED
    print(f"darkroom: {counts.get('acted', 0)} photo(s) acted on but not handed over (a "
          "failed delete, said above): run the same command again", file=sys.stderr)  # fmt: skip
    return 1


async def _watch_signals(stop: anyio.Event) -> None:
    """SIGINT/SIGTERM: stop after the photo in hand; the run records `interrupted`."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return


async def _plan(settings: Settings, args: argparse.Namespace) -> Plan | str:
    """The plan from the flags, or from the resumed action's frozen selection; or what is
    wrong with them."""
    if args.verb == "erase" and not (args.reason or "").strip():
        return "erase needs --reason (the audit trail keeps it)"
    if args.resume:
        async with services(settings, 1) as (pool, _):
            row = await selection.started(pool, args.resume)
        if row is None or row["action"] != action_name(args.verb):
            return f"no {args.verb} action {args.resume} in the audit trail"
        return Plan.thawed(args.verb, row["selection"])
    where = selection_of(args)
    return plan_of(args.verb, where, args.to_lane, args.to_tenant, args.original)


def selection_of(args: argparse.Namespace) -> Selection:
    return Selection(
        tenant=args.tenant, state=args.state, code=args.code,
        created_since=args.created_since, created_until=args.created_until,
        processed_since=args.processed_since, processed_until=args.processed_until,
        lane=args.lane, format=args.format,
    )  # fmt: skip


def _timestamp(raw: str) -> datetime:
    value = datetime.fromisoformat(raw)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def filter_arguments(command: argparse.ArgumentParser) -> None:
    """The selection's filters, shared by `select`, `bulk` and `erase`."""
    command.add_argument("--tenant", type=parse_tenant, help="only this tenant's photos")
    command.add_argument("--state", choices=views.STATES)
    command.add_argument("--code", help="only failed photos with this error code")
    for when in ("created", "processed"):
        for edge, word in (("since", "at or after"), ("until", "before")):
            command.add_argument(f"--{when}-{edge}", type=_timestamp, metavar="TIME",
                                 help=f"{when} {word} (ISO 8601, UTC)")  # fmt: skip
    command.add_argument("--lane", type=parse_lane, help="only photos of this lane")
    command.add_argument("--format", help="only this source format (jpeg, heic, ...)")


def select_arguments(command: argparse.ArgumentParser) -> None:
    filter_arguments(command)
    command.add_argument("--count", action="store_true", help="print only the exact count")
    command.add_argument("--sample", type=int, default=0, metavar="N", help="N matching ids")
    command.add_argument("--json", action="store_true", help='{"count": N, "sample": [...]}')


def bulk_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("verb", choices=list(VERBS))
    filter_arguments(command)
    command.add_argument("--to-lane", type=parse_lane,
                         help="move: the new lane; retry/rerender: the lane they go through "
                         "(default: the photo's own; bulk for rerender)")  # fmt: skip
    command.add_argument("--to-tenant", type=parse_tenant, help="move: the new tenant")
    command.add_argument("--original", action="store_true", help="erase: the originals too")
    command.add_argument("--reason", help="why (recorded in the audit trail; erase: required)")
    command.add_argument("--dry-run", action="store_true", help="count and sample; change nothing")
    run_arguments(command)


def run_arguments(command: argparse.ArgumentParser) -> None:
    """How a bulk run goes: its pace, its dry run's sample, the action it continues."""
    command.add_argument("--rate", type=_rate, help="at most N/s (or N/m)")
    command.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    command.add_argument("--sample", type=int, default=10, help="--dry-run: show N ids")
    resume_help = "continue this action (its frozen selection; other filters are ignored)"
    command.add_argument("--resume", type=uuid.UUID, metavar="ACTION_ID", help=resume_help)


SUBCOMMANDS = {
    "select": (
        "count (exactly) and sample the photos a selection matches",
        "darkroom select --tenant acme --state processing_failed --code render_timeout --count",
    ),
    "bulk": (
        "retry, re-render, move or erase every photo a selection matches: paced, audited, "
        "resumable",
        'darkroom bulk retry --tenant acme --code render_timeout --reason "codec fixed" '
        '--rate 50/s\n  darkroom bulk erase --tenant acme --original --reason "account closed"',
    ),
}
ARGUMENTS = {"select": select_arguments, "bulk": bulk_arguments}
COMMANDS = {"select": cmd_select, "bulk": cmd_bulk}
