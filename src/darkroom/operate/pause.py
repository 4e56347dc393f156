"""`darkroom pause` and `darkroom resume`: hold a lane, a tenant, both or everything (no
new photo of the scope starts; those in progress finish) and let it go again; their
grammar, and how a pause reads to people. The truth is in PostgreSQL (store/pauses.py).
"""

from __future__ import annotations

import argparse
import re
from datetime import datetime
from typing import Any

from darkroom.operate.audit import cli_action
from darkroom.queue.lanes import parse_lane, parse_tenant
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import pauses

UNITS_S = {"s": 1, "m": 60, "h": 3600}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smh])")

SUBCOMMANDS = {
    "pause": (
        "stop starting new photos of a lane, a tenant or everything (in progress finish)",
        'darkroom pause --lane bulk --tenant acme --reason "acme over quota" --for 2h',
    ),
    "resume": (
        "end the pauses inside a scope (no --lane/--tenant: every pause)",
        "darkroom resume --lane bulk --tenant acme",
    ),
}


def parse_for(text: str) -> float:
    """A duration such as 90s, 15m or 2h, in seconds (more than 0)."""
    found = _DURATION.fullmatch(text.strip())
    if found is None or float(found[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 15m or 2h")
    return float(found[1]) * UNITS_S[found[2]]


def _scope_arguments(command: argparse.ArgumentParser, verb: str) -> None:
    command.add_argument("--lane", type=parse_lane, help=f"{verb} this lane only")
    command.add_argument("--tenant", type=parse_tenant, help=f"{verb} this tenant only")


def _pause_arguments(pause: argparse.ArgumentParser) -> None:
    _scope_arguments(pause, "pause")
    pause.add_argument("--reason", required=True, help="why (shown wherever the pause is)")
    pause.add_argument("--for", dest="for_s", type=parse_for, metavar="DURATION",
                       help="resume by itself after this long (90s, 15m, 2h)")  # fmt: skip


def _resume_arguments(resume: argparse.ArgumentParser) -> None:
    _scope_arguments(resume, "resume")
    resume.add_argument("--reason", help="why (kept in the audit trail)")


def register(subcommands: dict[str, Any], arguments: dict[str, Any]) -> None:
    """cli_parser's registration of both commands: help, example and arguments."""
    subcommands.update(SUBCOMMANDS)
    arguments.update({"pause": _pause_arguments, "resume": _resume_arguments})


def scope_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    return args.lane, args.tenant


def selection(scope: tuple[str | None, str | None]) -> dict[str, Any]:
    return {"lane": scope[0], "tenant": scope[1]}


async def cmd_pause(settings: Settings, args: argparse.Namespace) -> int:
    scope = scope_of(args)
    action = cli_action(settings, "pause", selection(scope), args.reason)
    async with services(settings, 1) as (pool, _):
        row = await pauses.pause(pool, action, scope, args.for_s)
    print(f"paused {describe(row)}")
    return 0


async def cmd_resume(settings: Settings, args: argparse.Namespace) -> int:
    scope = scope_of(args)
    action = cli_action(settings, "resume", selection(scope), args.reason)
    async with services(settings, 1) as (pool, _):
        ended = await pauses.resume(pool, action, scope)
    for row in ended:
        print(f"resumed {describe(row)}")
    if not ended:
        print("nothing was paused in that scope")
    return 0


COMMANDS = {"pause": cmd_pause, "resume": cmd_resume}


def describe(row: dict[str, Any]) -> str:
    """One pause as people read it: scope, who, since and until when, and why."""
    until = "until resumed" if row["until"] is None else f"until {_at(row['until'])}"
    return (f"lane={row['lane'] or '*'} tenant={_tenant(row['tenant'])}  by {row['operator']}"
            f"  since {_at(row['since'])}  {until}  reason: {row['reason']}")  # fmt: skip


def _tenant(tenant: str | None) -> str:
    return "*" if tenant is None else repr(tenant) if tenant == "" else tenant


def _at(when: datetime) -> str:
    return f"{when:%Y-%m-%dT%H:%M:%S}Z"
