"""Bulk actions by query: `darkroom select` (an exact count and a sample of the photos a
selection matches) and `darkroom bulk retry|rerender|move` over the same selection, paced,
with a progress bar, an audit trail, and resumable: a rerun continues, never doubles.
The web page's "retry all N matching" runs the same `run`.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import anyio
import msgspec

from darkroom.operate import audit as audit_command
from darkroom.operate import ops
from darkroom.operate.progress import Pacer, Progress, parse_rate
from darkroom.queue.lanes import parse_lane, parse_tenant
from darkroom.queue.streams import Streams
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import audit, db, selection, views
from darkroom.store.selection import Selection

VERBS = {"retry": "retried", "rerender": "re-render requested", "move": "moved"}
# The state each verb acts on: a selection naming another is a usage error.
STATE_OF = {"retry": "processing_failed", "rerender": "processed"}
# What a run prints of an item that was not acted on (None: another run took it first).
SAID = {None: "taken by another run", "skipped": "skipped (no longer matches)"}
BATCH = 500
# One commit for up to GROUP photos (an fsync each: alone, a commit per photo bounds a run
# at a few hundred photos a second); a paced run groups what GROUP_S of its rate allows.
GROUP = 50
GROUP_S = 0.05
INTERRUPTED = 130


@dataclass(frozen=True)
class Plan:
    """What to do to which photos: the verb, the selection, and where they go (`to_lane`:
    the lane a retried or re-rendered photo goes through, or a move's new lane)."""

    verb: str
    where: Selection
    to_lane: str | None = None
    to_tenant: str | None = None

    def frozen(self) -> dict[str, Any]:
        """The selection as the audit trail records it, with where the photos go."""
        extra = {"to_lane": self.to_lane, "to_tenant": self.to_tenant}
        return {**self.where.as_json(), **{k: v for k, v in extra.items() if v is not None}}

    @classmethod
    def thawed(cls, verb: str, frozen: dict[str, Any]) -> Plan:
        where = Selection.from_json(frozen)
        return cls(verb, where, frozen.get("to_lane"), frozen.get("to_tenant"))

    def act(self) -> selection.Act:
        if self.verb == "move":
            return selection.mover(self.to_lane, self.to_tenant)
        act = selection.retry if self.verb == "retry" else selection.rerender
        return selection.feeding(act, self.to_lane)


@dataclass
class Run:
    """One run of an action: its audit identity, its pace and where it reports."""

    action: audit.Action
    plan: Plan
    rate_per_s: float | None = None
    batch: int = BATCH
    limit: int | None = None  # the page acts on at most this many per request
    out: TextIO | None = None
    stopped: Callable[[], bool] = lambda: False
    counts: dict[str, int] = field(default_factory=dict)


def action_name(verb: str) -> str:
    return f"bulk.{verb}"


async def begin(pool: db.Pool, run: Run) -> tuple[int, bool]:
    """Freeze the selection and record `started` with its exact count, in one
    transaction; or continue the unfinished action of the same verb and selection. The
    action's total, and whether it resumed."""
    name, frozen = action_name(run.plan.verb), run.plan.frozen()
    previous = await selection.unfinished(pool, name, frozen)
    if previous is not None:
        run.action = msgspec.structs.replace(run.action, action_id=previous)
        total = sum((await selection.tally(pool, previous)).values())
        await audit.record(pool, run.action, "started", total, {"resumed": True})
        return total, True
    async with pool.acquire() as conn, conn.transaction():
        total = await selection.freeze(conn, run.action.action_id, run.plan.where)
        await audit.record(conn, run.action, "started", total)
    return total, False


async def execute(pool: db.Pool, streams: Streams, run: Run, progress: Progress) -> bool:
    """Act on the action's pending items batch by batch, in id order, each at most once;
    True if none is left (False: stopped, or the run's limit reached)."""
    action_id, act, pacer = run.action.action_id, run.plan.act(), Pacer(run.rate_per_s)
    await _hand_over(pool, streams, run)  # acted by a run killed before its hand-over
    after, acted = selection.ZERO, 0
    while not run.stopped() and (run.limit is None or acted < run.limit):
        room = run.batch if run.limit is None else min(run.batch, run.limit - acted)
        ids = await selection.batch(pool, action_id, "pending", after, room)
        if not ids:
            return True
        for group in _groups(ids, run.rate_per_s):
            for _ in group:
                await pacer.wait()
            for photo_id, outcome in await selection.act_group(pool, action_id, group, act):
                _report(run, progress, photo_id, outcome)
                if outcome == "acted":
                    await _deliver(pool, streams, run.plan, photo_id)
            acted, after = acted + len(group), group[-1]
            if run.stopped():
                break
        await _mark_sent(pool, run, ids)
    return not await selection.batch(pool, action_id, "pending", selection.ZERO, 1)


def _groups(ids: list[uuid.UUID], rate_per_s: float | None) -> list[list[uuid.UUID]]:
    """Commit groups: what the rate allows in GROUP_S (one photo at low rates), so a
    commit's cost is shared and a paced run still commits as it goes."""
    size = GROUP if rate_per_s is None else max(1, min(GROUP, int(rate_per_s * GROUP_S)))
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _report(run: Run, progress: Progress, photo_id: uuid.UUID, outcome: str | None) -> None:
    said = SAID.get(outcome, VERBS[run.plan.verb])
    progress.advance()
    if run.out is not None:
        progress.line(f"{photo_id}  {said}", run.out)


async def _deliver(pool: db.Pool, streams: Streams, plan: Plan, photo_id: uuid.UUID) -> None:
    """Into its lane (ops.enqueue_again: XADD, or the feeder). A photo gone or finished
    meanwhile is not enqueued; its item is done all the same."""
    await ops.enqueue_again(pool, streams, photo_id, plan.to_lane, None)


async def _mark_sent(pool: db.Pool, run: Run, ids: list[uuid.UUID]) -> None:
    if run.plan.verb != "move":
        await selection.mark_sent(pool, run.action.action_id, ids)


async def _hand_over(pool: db.Pool, streams: Streams, run: Run) -> None:
    """Items a killed run acted on but never handed to their lane: handed over now (a
    second entry of one it did hand over ends `busy` or `already`, never a second act)."""
    after = selection.ZERO
    while ids := await selection.batch(pool, run.action.action_id, "acted", after, run.batch):
        for photo_id in ids:
            await _deliver(pool, streams, run.plan, photo_id)
        await _mark_sent(pool, run, ids)
        after = ids[-1]


async def finish(pool: db.Pool, run: Run, complete: bool) -> dict[str, int]:
    """`done` (or `interrupted`: a rerun continues) with the items' counts."""
    counts = await selection.tally(pool, run.action.action_id)
    acted = counts.get("sent", 0) + counts.get("acted", 0)
    outcome: audit.Outcome = "done" if complete else "interrupted"
    await audit.record(pool, run.action, outcome, acted, counts)
    run.counts = counts
    return counts


async def dry_run(pool: db.Pool, run: Run, sample_n: int) -> tuple[int, list[uuid.UUID]]:
    """The exact count and a sample, recorded as `dry_run`; nothing else changes."""
    total = await selection.count(pool, run.plan.where)
    ids = await selection.sample(pool, run.plan.where, sample_n)
    await audit.record(pool, run.action, "dry_run", total, {"sample": [str(i) for i in ids]})
    return total, ids


# -- the command line ---------------------------------------------------------------------


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
    run = Run(action, plan, args.rate, args.batch, out=sys.stdout)
    async with services(settings, 2) as (pool, streams):
        if args.dry_run:
            total, ids = await dry_run(pool, run, args.sample)
            for photo_id in ids:
                print(f"{photo_id}  would be {VERBS[plan.verb]}")
            print(f"would act on {total} photo(s) (dry run: nothing changed)", file=sys.stderr)
            return 0
        return await _run_until_signalled(pool, streams, run)


async def _run_until_signalled(pool: db.Pool, streams: Streams, run: Run) -> int:
    stop = anyio.Event()
    run.stopped = stop.is_set
    await streams.ensure_group()
    total, resumed = await begin(pool, run)
    action_id = run.action.action_id
    print(f"action {action_id}: {total} photo(s) selected{' (resumed)' if resumed else ''}; "
          f"rerun the same command, or `--resume {action_id}`, to continue after a stop",
          file=sys.stderr)  # fmt: skip
    progress = Progress(total, VERBS[run.plan.verb], sys.stderr)
    progress.done = total - (await selection.tally(pool, action_id)).get("pending", 0)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop)
            complete = await execute(pool, streams, run, progress)
            tg.cancel_scope.cancel()
    except Exception:
        # `interrupted`, never `failed`: a rerun must continue this action, not freeze anew
        with contextlib.suppress(Exception):  # the database may be what failed
            await finish(pool, run, False)
        raise
    counts = await finish(pool, run, complete)
    progress.finish(", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
    return 0 if complete else INTERRUPTED


async def _watch_signals(stop: anyio.Event) -> None:
    """SIGINT/SIGTERM: stop after the photo in hand; the run records `interrupted`."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return


async def _plan(settings: Settings, args: argparse.Namespace) -> Plan | str:
    """The plan from the flags, or from the resumed action's frozen selection; or what is
    wrong with them."""
    if args.resume:
        async with services(settings, 1) as (pool, _):
            row = await selection.started(pool, args.resume)
        if row is None or row["action"] != action_name(args.verb):
            return f"no {args.verb} action {args.resume} in the audit trail"
        return Plan.thawed(args.verb, row["selection"])
    return plan_of(args.verb, selection_of(args), args.to_lane, args.to_tenant)


def plan_of(verb: str, where: Selection, to_lane: str | None, to_tenant: str | None) -> Plan | str:
    if where.empty():
        return "a bulk action needs a selection (--tenant, --code, --state, ...)"
    wanted = STATE_OF.get(verb)
    if wanted and where.state not in (None, wanted):
        return f"{verb} acts on {wanted} photos; drop --state or name {wanted}"
    if verb == "move" and to_lane is None and to_tenant is None:
        return "move needs --to-lane and/or --to-tenant"
    if verb != "move" and to_tenant is not None:
        return "--to-tenant is for move"
    where = msgspec.structs.replace(where, state=wanted or where.state)
    return Plan(verb, where, to_lane or ("bulk" if verb == "rerender" else None), to_tenant)


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


def _filters(command: argparse.ArgumentParser) -> None:
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
    _filters(command)
    command.add_argument("--count", action="store_true", help="print only the exact count")
    command.add_argument("--sample", type=int, default=0, metavar="N", help="N matching ids")
    command.add_argument("--json", action="store_true", help='{"count": N, "sample": [...]}')


def bulk_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("verb", choices=list(VERBS))
    _filters(command)
    command.add_argument("--to-lane", type=parse_lane,
                         help="move: the new lane; retry/rerender: the lane they go through "
                         "(default: the photo's own; bulk for rerender)")  # fmt: skip
    command.add_argument("--to-tenant", type=parse_tenant, help="move: the new tenant")
    command.add_argument("--reason", help="why (recorded in the audit trail)")
    command.add_argument("--rate", type=_rate, help="at most N/s (or N/m)")
    command.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    command.add_argument("--dry-run", action="store_true", help="count and sample; change nothing")
    command.add_argument("--sample", type=int, default=10, help="--dry-run: show N ids")
    resume_help = "continue this action (its frozen selection; other filters are ignored)"
    command.add_argument("--resume", type=uuid.UUID, metavar="ACTION_ID", help=resume_help)


SUBCOMMANDS = {
    "select": (
        "count (exactly) and sample the photos a selection matches",
        "darkroom select --tenant acme --state processing_failed --code render_timeout --count",
    ),
    "bulk": (
        "retry, re-render or move every photo a selection matches: paced, audited, resumable",
        'darkroom bulk retry --tenant acme --code render_timeout --reason "codec fixed" '
        "--rate 50/s",
    ),
}
ARGUMENTS = {"select": select_arguments, "bulk": bulk_arguments}
COMMANDS = {"select": cmd_select, "bulk": cmd_bulk}
