"""`darkroom audit`: the operator's audit trail, newest first; and who the command line
acts as (DARKROOM_OPERATOR, else the login user), for every operator command's row."""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

import msgspec

from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import audit


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
