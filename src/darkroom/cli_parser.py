"""The `darkroom` command line's grammar: each command's help text, example and arguments.

cli.py parses argv with `build_parser()` and dispatches the command; the argument types
here refuse a bad value with argparse's usage error (exit 2) before any service is opened.
"""

from __future__ import annotations

import argparse
import uuid
from datetime import UTC, datetime
from pathlib import Path

from darkroom import __version__
from darkroom.operate import bulk_commands, erase, gc, limits, ops, pause
from darkroom.operate import events as events_command
from darkroom.operate.progress import parse_rate
from darkroom.queue.lanes import parse_lane, parse_tenant

DESCRIPTION = """\
darkroom turns uploaded photo originals into the renditions users see. Producers store an
original, insert a `photos` row and XADD its id to a Redis stream; `darkroom run` reads the
stream through a consumer group, renders with libvips and publishes in PostgreSQL.

Every setting is a DARKROOM_* environment variable (docs/configuration.md); the commands
are described in docs/operations.md."""

EPILOG = """\
examples:
  darkroom migrate && darkroom ingest photo.jpg && darkroom run --drain
  darkroom COMMAND --help     # what a command does, with an example

exit codes: 0 ok, 1 a dependency failed (the message starts with its error code),
2 a bad setting or usage, 3 `run --drain` stopped in an outage (the message names it),
130 stopped by a second signal."""


def build_parser() -> argparse.ArgumentParser:
    """`darkroom [--version] COMMAND ...` with every command's help, example and arguments."""
    parser = argparse.ArgumentParser(
        prog="darkroom", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"darkroom {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, example) in SUBCOMMANDS.items():
        command = sub.add_parser(
            name, help=help_text, description=help_text, epilog=f"example:\n  {example}",
            formatter_class=_Formatter,
        )  # fmt: skip
        ARGUMENTS.get(name, _no_arguments)(command)
    return parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the paragraphs and examples as written."""


SUBCOMMANDS = {
    "migrate": (
        "create the database if missing and apply schema.sql (idempotent)",
        "DARKROOM_DATABASE_URL=postgresql://postgres@db/darkroom darkroom migrate",
    ),
    "ingest": (
        "do what a producer does: store originals, insert photos rows, XADD them",
        "darkroom ingest --lane bulk --tenant acme ~/Pictures/*.jpg > photo-ids.txt",
    ),
    "enqueue": (
        "XADD existing photos again, or re-render processed ones (--rerender)",
        "darkroom enqueue --rerender --state processed --since 2026-11-01",
    ),
    "check": (
        "self-check: every format decodes and encodes here; prints a table (exit 2 on failure)",
        "darkroom check",
    ),
    "retry": (
        "reset processing_failed photos to uploaded and enqueue them",
        "darkroom retry 0b5c4e2a-6d3f-4c1e-9a57-2f1d8e6b9c30",
    ),
    "run": (
        "run the worker until SIGTERM/SIGINT (or, with --drain, until nothing is left)",
        "DARKROOM_CONCURRENCY=2 darkroom run",
    ),
    "status": (
        "stream length, group lag, pending, consumers, dead letters, photos by state",
        "darkroom status --json | jq .photos",
    ),
    "photos": (
        "a table of recent photos and their outcomes; `photos show ID`: one photo's facts "
        "and its attempt timeline",
        "darkroom photos --state processing_failed --limit 20\n"
        "  darkroom photos show 0b5c4e2a-6d3f-4c1e-9a57-2f1d8e6b9c30 --json",
    ),
    "dlq": (
        "list or replay dead letters",
        "darkroom dlq replay --code storage_unavailable --rate 50/s --dry-run",
    ),
    "consumers": (
        "remove consumers of the group that are idle with nothing pending",
        "darkroom consumers prune --idle 3600000 --dry-run",
    ),
    "gc": (
        "delete rendition objects no photo references, older than a grace period (1 h)",
        "darkroom gc --dry-run --older-than 86400",
    ),
    "web": (
        "serve the operator's web page (settings DARKROOM_WEB_*)",
        "DARKROOM_WEB_PORT=8080 darkroom web",
    ),
    # The attempt history and the photo events, read back (docs/history.md, docs/events.md).
    "attempts": (
        "search the attempt history: every delivery a worker handled, newest first",
        "darkroom attempts --code render_timeout --since 2026-11-30 --limit 20 --json",
    ),
    "audit": (
        "the operator's audit trail: who paused, replayed, re-rendered or erased what, and why",
        "DARKROOM_OPERATOR=alice darkroom audit --since 2026-12-01 --json",
    ),
    "events": (
        "replay photo events from PostgreSQL in order (--follow: then print new ones)",
        "darkroom events --since 2026-12-01T09:00 --follow --json | jq .type",
    ),
    **bulk_commands.SUBCOMMANDS,
    "limits": limits.HELP,
    "erase": erase.HELP,
}


def _no_arguments(command: argparse.ArgumentParser) -> None:
    """Commands such as migrate, check and web take no arguments."""


def _ingest_arguments(ingest: argparse.ArgumentParser) -> None:
    ingest.add_argument("files", nargs="+", type=Path)
    _lane_arguments(ingest, "interactive")


def _lane_arguments(command: argparse.ArgumentParser, default: str | None) -> None:
    kept = f"default {default}" if default else "default: the photo's own"
    lane_help = f"interactive (XADD now) or bulk (fed fairly by tenant); {kept}"
    command.add_argument("--lane", type=parse_lane, default=default, help=lane_help)
    tenant_help = "whose photos these are (bulk shares are fair between tenants)"
    command.add_argument("--tenant", type=parse_tenant, default=None, help=tenant_help)


def _enqueue_arguments(enqueue: argparse.ArgumentParser) -> None:
    enqueue.add_argument("photo_ids", nargs="*", type=uuid.UUID)
    enqueue.add_argument(
        "--rerender", action="store_true", help="re-render processed photos in place"
    )
    enqueue.add_argument("--state", choices=["processed"], help="with --since: select by state")
    enqueue.add_argument("--since", type=_timestamp, help="with --state processed: processed since")
    # --rerender --since without --lane: bulk (a whole library must not hold up uploads)
    _lane_arguments(enqueue, None)
    _reason_argument(enqueue)


def _retry_arguments(retry: argparse.ArgumentParser) -> None:
    retry.add_argument("photo_ids", nargs="+", type=uuid.UUID)
    _reason_argument(retry)


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--drain", action="store_true", help="exit 0 once nothing is new or pending")


def _status_arguments(status: argparse.ArgumentParser) -> None:
    status.add_argument("--json", action="store_true")


def _dlq_arguments(dlq: argparse.ArgumentParser) -> None:
    dlq.add_argument("action", choices=["list", "replay"])
    dlq.add_argument("--code", action="append", help="only this error code (repeatable)")
    dlq.add_argument("--limit", type=int, help="at most this many (list: 1000 by default)")
    dlq.add_argument("--dry-run", action="store_true", help="replay: show what would be replayed")
    dlq.add_argument("--json", action="store_true", help="list: one JSON array")
    dlq.add_argument("--rate", type=_rate, help="replay: at most N/s (or N/m)")
    _reason_argument(dlq)


def _photos_arguments(photos: argparse.ArgumentParser) -> None:
    photos.add_argument(
        "--state", choices=["uploaded", "processing", "processed", "processing_failed", "erased"]
    )
    photos.add_argument("--limit", type=int, default=50)
    photos.add_argument("--json", action="store_true")
    photos.add_argument("action", nargs="?", choices=["show"], help="show one photo")
    photos.add_argument("photo_id", nargs="?", type=uuid.UUID, metavar="PHOTO_ID")


def _attempts_arguments(attempts: argparse.ArgumentParser) -> None:
    attempts.add_argument("--code", help="only deliveries that ended with this error code")
    attempts.add_argument("--since", type=_timestamp, help="only those started since (ISO 8601)")
    attempts.add_argument("--consumer", help="only those of this consumer")
    attempts.add_argument("--limit", type=int, default=50)
    attempts.add_argument("--json", action="store_true")


def _consumers_arguments(consumers: argparse.ArgumentParser) -> None:
    consumers.add_argument("action", choices=["prune"])
    consumers.add_argument("--idle", type=int, default=ops.IDLE_BOUND_MS, metavar="MS")
    consumers.add_argument("--dry-run", action="store_true")
    _reason_argument(consumers)


def _gc_arguments(collect: argparse.ArgumentParser) -> None:
    collect.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    collect.add_argument(
        "--older-than", type=_grace, default=gc.GRACE_S, metavar="SECONDS",
        help=f"only objects written this long ago (default {gc.GRACE_S:g}, at least "
        f"{gc.MIN_GRACE_S:g}: a younger one may be an upload about to be published)",
    )  # fmt: skip
    _reason_argument(collect)


def _events_arguments(events: argparse.ArgumentParser) -> None:
    events.add_argument("--since", type=events_command.parse_since, metavar="ID|TIME",
                        help="after this event's id, or from this ISO 8601 time (UTC)")  # fmt: skip
    events.add_argument("--follow", action="store_true", help="keep printing new events")
    events.add_argument("--json", action="store_true", help="one CloudEvents JSON per line")


def _reason_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("--reason", help="why, for the audit trail (`darkroom audit`)")


def _audit_arguments(audit: argparse.ArgumentParser) -> None:
    audit.add_argument("--since", type=_timestamp, help="only actions since (ISO 8601, UTC)")
    audit.add_argument("--action", help="only this action (pause, dlq.replay, gc, ...)")
    audit.add_argument("--limit", type=int, default=100)
    audit.add_argument("--json", action="store_true", help="one JSON array")


ARGUMENTS = {
    "audit": _audit_arguments,
    "ingest": _ingest_arguments,
    "enqueue": _enqueue_arguments,
    "retry": _retry_arguments,
    "run": _run_arguments,
    "status": _status_arguments,
    "dlq": _dlq_arguments,
    "photos": _photos_arguments,
    "consumers": _consumers_arguments,
    "gc": _gc_arguments,
    "attempts": _attempts_arguments,
    "events": _events_arguments,
    **bulk_commands.ARGUMENTS,
    "limits": limits.arguments,
    "erase": erase.add_arguments,
}
pause.register(SUBCOMMANDS, ARGUMENTS)


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _grace(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= gc.MIN_GRACE_S:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be at least {gc.MIN_GRACE_S:g} seconds")
    return seconds


def _timestamp(raw: str) -> datetime:
    value = datetime.fromisoformat(raw)
    return value if value.tzinfo else value.replace(tzinfo=UTC)
