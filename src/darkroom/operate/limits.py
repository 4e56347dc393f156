"""`darkroom limits set|list|clear`: the tenants' own bulk rates, stored in PostgreSQL (the
feeder reloads them within LIMITS_EVERY_S) with an audit row per change; and the
command's arguments, registered by cli_parser.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from darkroom.config.convert import rate_per_s
from darkroom.operate.audit import cli_action
from darkroom.queue.lanes import parse_tenant
from darkroom.queue.limits import Rate
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import limits

MAX_PER_S = 1_000_000
HELP = (
    "per-tenant bulk rate limits: set, list or clear a tenant's own (DARKROOM_TENANT_RATE "
    "is everyone else's)",
    "darkroom limits set acme 20/s --burst 100 --reason 'contract tier'\n"
    "  darkroom limits list --json\n  darkroom limits clear acme",
)


async def cmd_limits(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, _):
        if args.limits_command == "set":
            limit = limit_of(args.tenant, args.rate, args.burst, args.interactive)
            action = cli_action(settings, "limits.set", {"tenant": args.tenant}, args.reason)
            await limits.set_limit(pool, limit, action)
            print(f"{limit.tenant}: {limit.shown} burst {limit.burst}", file=sys.stderr)
            return 0
        if args.limits_command == "clear":
            action = cli_action(settings, "limits.clear", {"tenant": args.tenant}, args.reason)
            if await limits.clear_limit(pool, args.tenant, action):
                return 0
            print(f"{args.tenant!r} has no limit of its own: nothing cleared", file=sys.stderr)
            return 1
        rows = await limits.listed(pool)
    print_limits(rows, settings, args.json)
    return 0


def limit_of(tenant: str, shown: str, burst: int | None, interactive: bool) -> limits.Limit:
    """The limit a `set` asks for; its burst defaults to one second's worth (at least 1)."""
    per_s = rate_per_s(shown)
    return limits.Limit(
        tenant=tenant, per_s=per_s, burst=burst or Rate(per_s).photos_at_once,
        interactive=interactive, shown=shown.strip(),
    )  # fmt: skip


def print_limits(rows: list[dict[str, object]], settings: Settings, as_json: bool) -> None:
    if as_json:
        default = {"per_s": settings.tenant_rate, "burst": settings.tenant_burst}
        print(msgspec.json.encode({"default": default, "tenants": rows}).decode())
        return
    print("tenant  rate  burst  interactive  updated_at")
    for row in rows:
        interactive = "charged" if row["interactive"] else "exempt"
        print(f"{row['tenant']}  {row['shown']}  {row['burst']}  {interactive}  "
              f"{row['updated_at']:%Y-%m-%dT%H:%M:%S}Z")  # fmt: skip
    print(f"{len(rows)} tenant(s) with a limit of their own; every other tenant: "
          f"{settings.tenant_rate:g}/s (0: unlimited)", file=sys.stderr)  # fmt: skip


def arguments(command: argparse.ArgumentParser) -> None:
    sub = command.add_subparsers(dest="limits_command", required=True, metavar="ACTION")
    put = sub.add_parser("set", help="set a tenant's own rate (replacing the one it had)")
    put.add_argument("tenant", type=_tenant)
    put.add_argument("rate", type=_rate, help="N/s, N/m or N (per second); 0: unlimited")
    put.add_argument("--burst", type=_burst, help="photos at once after an idle spell "
                     "(default: one second's worth)")  # fmt: skip
    put.add_argument(
        "--interactive",
        action="store_true",
        help="charge its interactive photos too (never delayed; its bulk waits)",
    )
    put.add_argument("--reason", help="why, for the audit trail")
    clear = sub.add_parser("clear", help="drop a tenant's own rate (DARKROOM_TENANT_RATE again)")
    clear.add_argument("tenant", type=_tenant)
    clear.add_argument("--reason", help="why, for the audit trail")
    shown = sub.add_parser("list", help="the tenants' own rates and the default")
    shown.add_argument("--json", action="store_true", help="one JSON object")


def _tenant(text: str) -> str:
    try:
        return parse_tenant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(text: str) -> str:
    try:
        per_s = rate_per_s(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if per_s > MAX_PER_S:  # schema.sql's tenant_limits_per_s_check
        raise argparse.ArgumentTypeError(f"rate must be at most {MAX_PER_S:g}/s, got {text!r}")
    return text


def _burst(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"burst must be a whole number of at least 1, got {text!r}"
        )
    return int(text)
