"""`darkroom audit`: the operator's audit trail, newest first; who the command line acts
as (DARKROOM_OPERATOR, else the login user); and `audited`, the one way an operator action
(command line or page) writes its rows: `started` for a long one, then exactly one ending.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
import structlog

from darkroom.errors import DarkroomError
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import audit, db

log = structlog.get_logger("darkroom.audit")
# What `darkroom` exits with when a signal stopped an action (as a second signal stops the
# worker): the trail says how far it got.
INTERRUPTED_EXIT = 130
T = TypeVar("T")


def cli_action(
    settings: Settings, action: str, selection: dict[str, Any], reason: str | None = None
) -> audit.Action:
    """An action taken from the command line, in the name of DARKROOM_OPERATOR (else the
    login user, else `unknown`: a container may have no name for its uid)."""
    return audit.Action(
        operator=settings.operator or _login() or "unknown",
        via="cli", action=action, selection=selection, reason=reason,
    )  # fmt: skip


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, no LOGNAME/USER
        return ""


async def cmd_audit(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, _):
        rows = await audit.since(pool, args.since, args.limit, args.action)
    if args.json:
        print(msgspec.json.encode(rows).decode())
        return 0
    print("at  operator  via  action  outcome  count  selection  reason")
    for row in rows:
        print(line(row))
    print(f"{len(rows)} action row(s), newest first", file=sys.stderr)
    return 0


def line(row: dict[str, Any]) -> str:
    count = "-" if row["count"] is None else str(row["count"])
    selection = msgspec.json.encode(row["selection"]).decode()
    return (
        f"{row['at']:%Y-%m-%dT%H:%M:%S}Z  {row['operator']}  {row['via']}  {row['action']}  "
        f"{row['outcome']}  {count}  {selection}  {row['reason'] or '-'}"
    )


@dataclass
class Tally:
    """What an action did so far: its ending row's count, outcome and detail."""

    count: int = 0
    outcome: audit.Outcome = "done"
    detail: dict[str, Any] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def audited(pool: db.Pool, action: audit.Action, long: bool = True) -> AsyncIterator[Tally]:
    """Around an action: a long one writes `started` first, so a crash midway still shows
    it was begun; every one writes one ending: the tally's outcome, `interrupted` when
    cancelled (a signal), `failed` with the error code when it raised."""
    if long:
        await audit.record(pool, action, "started")
    tally = Tally()
    try:
        yield tally
    except anyio.get_cancelled_exc_class():
        with anyio.CancelScope(shield=True):
            await _end(pool, action, "interrupted", tally)
        raise
    except Exception as exc:
        code = exc.code if isinstance(exc, DarkroomError) else "internal_error"
        tally.detail["error_code"] = code
        await _end(pool, action, "failed", tally)
        raise
    await _end(pool, action, tally.outcome, tally)


async def _end(pool: db.Pool, action: audit.Action, outcome: audit.Outcome, tally: Tally) -> None:
    """The ending row; when the database itself is what failed, the row cannot be written:
    say so in the log and let the action's own error through."""
    try:
        await audit.record(pool, action, outcome, tally.count, tally.detail or None)
    except DarkroomError as exc:
        log.warning("audit row not written", action=action.action, outcome=outcome,
                    action_id=str(action.action_id), error=str(exc))  # fmt: skip


async def until_signalled(body: Callable[[], Awaitable[T]]) -> T | None:
    """Run a command's action; SIGINT or SIGTERM cancels it (its `audited` block records
    `interrupted`) and None comes back instead of the process dying unrecorded."""
    result: T | None = None
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        result = await body()
        tg.cancel_scope.cancel()
    return result


async def run_interruptible(body: Callable[[], Awaitable[int]]) -> int:
    """A command's exit status, INTERRUPTED_EXIT when a signal stopped it."""
    status = await until_signalled(body)
    return INTERRUPTED_EXIT if status is None else status
