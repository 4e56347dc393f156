"""Bulk actions by query: retry, re-render, move or erase every photo a selection matches,
over the ids it matched when the action began (frozen in bulk_action_items), paced, with a
progress bar, an audit trail, and resumable: a rerun continues, never doubles. The command
line (operate/bulk_commands.py) and the web page's "retry all N matching" run the same
`begin`, `execute` and `finish`.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgspec

from darkroom.operate import ops
from darkroom.operate.progress import Pacer, Progress
from darkroom.queue.streams import Streams
from darkroom.store import audit, db, selection
from darkroom.store.selection import Selection

VERBS = {"retry": "retried", "rerender": "re-render requested", "move": "moved", "erase": "erased"}
# The state each verb acts on: a selection naming another is a usage error.
STATE_OF = {"retry": "processing_failed", "rerender": "processed"}
# What a run prints of an item that was not acted on (None: another run took it first).
SAID = {None: "taken by another run", "skipped": "skipped (no longer matches)"}
BATCH = 500
# One commit for up to GROUP photos (an fsync each: alone, a commit per photo bounds a run
# at a few hundred photos a second); a paced run groups what GROUP_S of its rate allows.
GROUP = 50
GROUP_S = 0.05


@dataclass(frozen=True)
class Plan:
    """What to do to which photos: the verb, the selection, and where they go (`to_lane`:
    the lane a retried or re-rendered photo goes through, or a move's new lane)."""

    verb: str
    where: Selection
    to_lane: str | None = None
    to_tenant: str | None = None
    original: bool = False  # erase: the originals' objects too

    def frozen(self) -> dict[str, Any]:
        """The selection as the audit trail records it, with where the photos go."""
        extra = {"to_lane": self.to_lane, "to_tenant": self.to_tenant,
                 "original": self.original or None}  # fmt: skip
        return {**self.where.as_json(), **{k: v for k, v in extra.items() if v is not None}}

    @classmethod
    def thawed(cls, verb: str, frozen: dict[str, Any]) -> Plan:
        where = Selection.from_json(frozen)
        return cls(verb, where, frozen.get("to_lane"), frozen.get("to_tenant"),
                   bool(frozen.get("original")))  # fmt: skip

    def act(self) -> selection.Act:
        if self.verb == "erase":
            return selection.eraser(self.where)
        if self.verb == "move":
            return selection.mover(self.to_lane, self.to_tenant)
        act = selection.retry if self.verb == "retry" else selection.rerender
        return selection.feeding(act, self.to_lane)


# What follows a photo's commit outside the transaction (its hand-over; by default into
# its lane): True once done (its item becomes `sent`), False to leave the item `acted`,
# for a rerun of the action to hand over again.
Deliver = Callable[[uuid.UUID], Awaitable[bool]]


@dataclass
class Run:
    """One run of an action: its audit identity, its pace, where it reports, and its
    hand-over with what that counted (an erase's objects deleted)."""

    action: audit.Action
    plan: Plan
    rate_per_s: float | None = None
    batch: int = BATCH
    limit: int | None = None  # the page acts on at most this many per request
    out: TextIO | None = None
    stopped: Callable[[], bool] = lambda: False
    counts: dict[str, int] = field(default_factory=dict)
    deliver: Deliver | None = None
    tally: Counter[str] = field(default_factory=Counter)
    resuming: bool = False  # `--resume ACTION_ID`: that action's items, never a new freeze


def action_name(verb: str) -> str:
    return f"bulk.{verb}"


async def begin(pool: db.Pool, run: Run) -> tuple[int, bool]:
    """Freeze the selection and record `started` with its exact count, in one
    transaction; or continue the action named by `--resume` (its own frozen items, however
    old or ended: never a new freeze under its id, which would add photos selected only
    now), or else the unfinished action of the same verb and selection. The action's
    total, and whether it resumed."""
    if run.resuming:
        return await _resumed(pool, run)
    previous = await selection.unfinished(pool, action_name(run.plan.verb), run.plan.frozen())
    if previous is not None:
        run.action = msgspec.structs.replace(run.action, action_id=previous)
        return await _resumed(pool, run)
    async with pool.acquire() as conn, conn.transaction():
        total = await selection.freeze(conn, run.action.action_id, run.plan.where)
        await audit.record(conn, run.action, "started", total)
    return total, False


async def _resumed(pool: db.Pool, run: Run) -> tuple[int, bool]:
    total = sum((await selection.tally(pool, run.action.action_id)).values())
    await audit.record(pool, run.action, "started", total, {"resumed": True})
    return total, True


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
            break
        handed: list[uuid.UUID] = []
        for group in _groups(ids, run.rate_per_s):
            for _ in group:
                await pacer.wait()
            for photo_id, outcome in await selection.act_group(pool, action_id, group, act):
                _report(run, progress, photo_id, outcome)
                if outcome == "acted" and await _deliver(pool, streams, run, photo_id):
                    handed.append(photo_id)
            acted, after = acted + len(group), group[-1]
            if run.stopped():
                break
        await _mark_sent(pool, run, handed)
    return not any([await selection.batch(pool, action_id, state, selection.ZERO, 1)
                    for state in ("pending", "acted")])  # fmt: skip


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


async def _deliver(pool: db.Pool, streams: Streams, run: Run, photo_id: uuid.UUID) -> bool:
    """The run's hand-over, or into its lane (ops.enqueue_again: XADD, or the feeder). A
    photo gone or finished meanwhile is not enqueued; its item is done all the same."""
    if run.deliver is not None:
        return await run.deliver(photo_id)
    await ops.enqueue_again(pool, streams, photo_id, run.plan.to_lane, None)
    return True


async def _mark_sent(pool: db.Pool, run: Run, ids: list[uuid.UUID]) -> None:
    if ids:
        await selection.mark_sent(pool, run.action.action_id, ids)


async def _hand_over(pool: db.Pool, streams: Streams, run: Run) -> None:
    """Items a killed run acted on but never handed to their lane: handed over now (a
    second entry of one it did hand over ends `busy` or `already`, never a second act)."""
    after = selection.ZERO
    while ids := await selection.batch(pool, run.action.action_id, "acted", after, run.batch):
        await _mark_sent(pool, run, [p for p in ids if await _deliver(pool, streams, run, p)])
        after = ids[-1]


async def finish(pool: db.Pool, run: Run, complete: bool) -> dict[str, int]:
    """`done` (or `interrupted`: a rerun continues) with the items' counts and what the
    hand-over counted."""
    counts = await selection.tally(pool, run.action.action_id)
    acted = counts.get("sent", 0) + counts.get("acted", 0)
    outcome: audit.Outcome = "done" if complete else "interrupted"
    await audit.record(pool, run.action, outcome, acted, {**counts, **run.tally})
    run.counts = counts
    return counts


async def dry_run(pool: db.Pool, run: Run, sample_n: int) -> tuple[int, list[uuid.UUID]]:
    """The exact count and a sample, recorded as `dry_run`; nothing else changes."""
    total = await selection.count(pool, run.plan.where)
    ids = await selection.sample(pool, run.plan.where, sample_n)
    await audit.record(pool, run.action, "dry_run", total, {"sample": [str(i) for i in ids]})
    return total, ids


def plan_of(
    verb: str, where: Selection, to_lane: str | None, to_tenant: str | None,
    original: bool = False,
) -> Plan | str:  # fmt: skip
    """The plan, or what is wrong with the flags."""
    wrong = _usage(verb, where, to_lane, to_tenant, original)
    if wrong is not None:
        return wrong
    if verb == "erase":  # an erase of a selection naming no state: the photos not erased yet
        return Plan(verb, where if where.state else _unerased(where), original=original)
    wanted = STATE_OF.get(verb)
    where = msgspec.structs.replace(where, state=wanted or where.state)
    return Plan(verb, where, to_lane or ("bulk" if verb == "rerender" else None), to_tenant)


def _unerased(where: Selection) -> Selection:
    return msgspec.structs.replace(where, erased=False)


def _usage(
    verb: str, where: Selection, to_lane: str | None, to_tenant: str | None, original: bool
) -> str | None:
    wanted = STATE_OF.get(verb) or ("erased" if verb == "erase" else None)
    problems = {
        "a bulk action needs a selection (--tenant, --code, --state, ...)": where.empty(),
        f"{verb} acts on {wanted} photos; drop --state or name {wanted}":
            verb in STATE_OF and where.state not in (None, wanted),
        "erase acts on photos not erased yet; drop --state erased": where.state == wanted
            and verb == "erase",
        "move needs --to-lane and/or --to-tenant": verb == "move" and not (to_lane or to_tenant),
        "--to-tenant is for move": verb != "move" and to_tenant is not None,
        "--to-lane is not for erase": verb == "erase" and to_lane is not None,
        "--original is for erase": verb != "erase" and original,
    }  # fmt: skip
    return next((problem for problem, found in problems.items() if found), None)
