"""The `darkroom` command line: the worker (`run`), a producer (`ingest`) and operator commands.

The only place that reads argv and the environment and configures logging. Exit codes:
0 success, 1 a dependency failed, 2 bad settings or usage, 130 stopped by a second signal.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import uuid
from collections.abc import MutableMapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import structlog

from darkroom import __version__, metrics
from darkroom.errors import DarkroomError, SettingsError, first_error
from darkroom.health import DEPENDENCIES
from darkroom.image import selfcheck
from darkroom.image.cost import cost_of
from darkroom.operate import events as events_command
from darkroom.operate import gc, history, ops, web
from darkroom.operate.progress import Progress, parse_rate
from darkroom.queue.lanes import parse_lane, parse_tenant
from darkroom.queue.messages import task_fields
from darkroom.queue.streams import Streams
from darkroom.services import services, storage_for
from darkroom.settings import Settings, from_env, redact, servers
from darkroom.store import db
from darkroom.store import lanes as store_lanes
from darkroom.worker import Worker

log = structlog.get_logger("darkroom.cli")


# uvloop: the worker's own process spends a fifth less CPU per photo than on asyncio's
# default loop (docs/performance.md); asyncpg, redis-py and uvicorn all run on it.
LOOP = {"use_uvloop": True}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = from_env()
    except SettingsError as exc:
        print(redact(f"darkroom: invalid setting {exc}"), file=sys.stderr)
        return 2
    _configure_logging(settings)
    try:
        try:
            command = COMMANDS[args.command]
            return int(anyio.run(command, settings, args, backend_options=LOOP))
        except BaseExceptionGroup as group:
            raise first_error(group) from group
    except DarkroomError as exc:
        print(redact(f"darkroom: {exc.code}: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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


def _parser() -> argparse.ArgumentParser:
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
    # -- issue 14: attempt history (docs/history.md)
    "attempts": (
        "search the attempt history: every delivery a worker handled, newest first",
        "darkroom attempts --code render_timeout --since 2026-11-30 --limit 20 --json",
    ),
    "events": (
        "replay photo events from PostgreSQL in order (--follow: then print new ones)",
        "darkroom events --since 2026-12-01T09:00 --follow --json | jq .type",
    ),
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


def _retry_arguments(retry: argparse.ArgumentParser) -> None:
    retry.add_argument("photo_ids", nargs="+", type=uuid.UUID)


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


def _photos_arguments(photos: argparse.ArgumentParser) -> None:
    photos.add_argument(
        "--state", choices=["uploaded", "processing", "processed", "processing_failed"]
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


def _gc_arguments(collect: argparse.ArgumentParser) -> None:
    collect.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    collect.add_argument(
        "--older-than", type=_grace, default=gc.GRACE_S, metavar="SECONDS",
        help=f"only objects written this long ago (default {gc.GRACE_S:g}, at least "
        f"{gc.MIN_GRACE_S:g}: a younger one may be an upload about to be published)",
    )  # fmt: skip


def _events_arguments(events: argparse.ArgumentParser) -> None:
    events.add_argument("--since", type=events_command.parse_since, metavar="ID|TIME",
                        help="after this event's id, or from this ISO 8601 time (UTC)")  # fmt: skip
    events.add_argument("--follow", action="store_true", help="keep printing new events")
    events.add_argument("--json", action="store_true", help="one CloudEvents JSON per line")


ARGUMENTS = {
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
}


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


def _configure_logging(settings: Settings) -> None:
    level = logging.getLevelName(settings.log_level.upper())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _mask_passwords,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def _mask_passwords(logger: Any, method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """Every text of every log line, tracebacks included, with its passwords masked."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in event.items()}


async def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    created = await db.migrate(settings.database_url)
    print("database created and schema applied" if created else "schema applied")
    return 0


async def cmd_ingest(settings: Settings, args: argparse.Namespace) -> int:
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        print(f"darkroom: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    tenant = args.tenant or ""
    async with services(settings, 2) as (pool, streams), storage_for(settings) as storage:
        await streams.ensure_group()
        progress = Progress(len(args.files), "ingested", sys.stderr)
        for path in args.files:
            photo_id = uuid.uuid4()
            key = f"originals/{photo_id}/{_safe_name(path.name)}"
            data = await anyio.Path(path).read_bytes()
            await storage.put(key, data, "application/octet-stream")
            cost = await anyio.to_thread.run_sync(cost_of, data)
            await store_lanes.insert_photo(pool, photo_id, key, args.lane, tenant, cost)
            if args.lane == "interactive":  # bulk: the feeder XADDs it
                await streams.enqueue(task_fields(photo_id))
            progress.advance()
            progress.line(str(photo_id), sys.stdout)
        progress.finish()
    return 0


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".")
    return cleaned[:120] or "original"


def _timestamp(raw: str) -> datetime:
    value = datetime.fromisoformat(raw)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


async def cmd_enqueue(settings: Settings, args: argparse.Namespace) -> int:
    if args.rerender or args.state or args.since:
        return await ops.cmd_rerender(settings, args)
    if not args.photo_ids:
        print("darkroom: enqueue needs PHOTO_ID...", file=sys.stderr)
        return 2
    return await ops.cmd_enqueue(settings, args)


async def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    failed = selfcheck.failures(selfcheck.run(settings.renditions))
    if failed:
        names = ", ".join(f"{c.name} ({c.detail})" for c in failed)
        print(f"darkroom: self-check failed, not starting: {names}", file=sys.stderr)
        return 2
    async with (
        services(settings, settings.in_flight_bound + 2) as (pool, streams),
        storage_for(settings) as storage,
    ):
        worker = Worker(settings, pool, streams, storage)
        metrics.watch_outages(worker.gate.down, DEPENDENCIES)
        server = (
            await metrics.serve(settings.metrics_port, worker.readiness)
            if settings.metrics_port
            else None
        )
        log.info(
            "worker started",
            **servers(settings),
            consumer=settings.consumer,
            stream=settings.stream,
            group=settings.group,
            concurrency=settings.concurrency,
            drain=args.drain,
        )
        try:
            code = await _run_until_signalled(worker, args.drain)
            if code == 0:
                await _leave_group(streams)
            return code
        finally:
            if server is not None:
                server.close()


LEAVE_GROUP_TIMEOUT_S = 2.0


async def _leave_group(streams: Streams) -> None:
    """A clean exit removes this consumer from the group, unless it still holds entries."""
    removed = None
    try:
        with anyio.move_on_after(LEAVE_GROUP_TIMEOUT_S):  # Redis may be down: never hang
            removed = await streams.remove_self_if_idle()
    except DarkroomError as exc:
        log.warning("could not leave the consumer group", error=str(exc))
        return
    if removed is None:
        log.warning("could not leave the consumer group in time; `consumers prune` will")
        return
    log.info(
        "left the consumer group"
        if removed
        else "consumer kept: it still holds entries, or is no longer in the group"
    )


async def _run_until_signalled(worker: Worker, drain: bool) -> int:
    forced = False
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            nonlocal forced
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    if worker.stopping.is_set():
                        log.warning("second signal: exiting now; unacked entries stay pending")
                        forced = True
                        tg.cancel_scope.cancel()
                        return
                    log.info("signal received: draining in-flight photos", signal=signum)
                    worker.stop()

        tg.start_soon(watch_signals)
        await worker.run(drain=drain)
        tg.cancel_scope.cancel()
    log.info("worker stopped", forced=forced)
    if forced:
        return 130
    if worker.drain_outage is not None:
        print(redact(f"darkroom: drain incomplete: {worker.drain_outage}"), file=sys.stderr)
        return 3
    return 1 if worker.drain_failed is not None else 0


async def cmd_check(settings: Settings, args: argparse.Namespace) -> int:
    checks = selfcheck.run(settings.renditions)
    print(selfcheck.table(checks))
    return 2 if selfcheck.failures(checks) else 0


COMMANDS = {
    "check": cmd_check,
    "migrate": cmd_migrate,
    "ingest": cmd_ingest,
    "enqueue": cmd_enqueue,
    "run": cmd_run,
    "status": ops.cmd_status,
    "photos": history.cmd_photos,
    "dlq": ops.cmd_dlq,
    "retry": ops.cmd_retry,
    "consumers": ops.cmd_consumers,
    "gc": gc.cmd_gc,
    "web": web.cmd_web,
    "attempts": history.cmd_attempts,
    "events": events_command.cmd_events,
}
