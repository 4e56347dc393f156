"""The `darkroom` command line: the worker (`run`), a producer (`ingest`) and operator commands.

The only place that reads argv and the environment and configures logging. Exit codes:
0 success, 1 a dependency failed, 2 bad settings or usage, 130 stopped by a second signal.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import signal
import sys
import uuid
from collections.abc import MutableMapping, Sequence
from typing import Any

import anyio
import structlog

from darkroom import metrics, tracing
from darkroom.cli_parser import build_parser
from darkroom.config.env import from_env
from darkroom.errors import DarkroomError, SettingsError, first_error
from darkroom.health import DEPENDENCIES
from darkroom.image import selfcheck
from darkroom.image.cost import cost_of
from darkroom.image.forking import isolated
from darkroom.operate import acts, audit, bulk_commands, erase, gc, history, limits, ops, pause, web
from darkroom.operate import events as events_command
from darkroom.operate.progress import Progress
from darkroom.queue.messages import task_fields
from darkroom.queue.streams import Streams
from darkroom.services import services, storage_for
from darkroom.settings import Settings, redact, servers
from darkroom.store import db
from darkroom.store import lanes as store_lanes
from darkroom.worker import Worker

log = structlog.get_logger("darkroom.cli")


# uvloop: the worker's own process spends a fifth less CPU per photo than on asyncio's
# default loop (docs/performance.md); asyncpg, redis-py and uvicorn all run on it.
LOOP = {"use_uvloop": True}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = from_env()
    except SettingsError as exc:
        print(redact(f"darkroom: invalid setting {exc}"), file=sys.stderr)
        return 2
    _configure_logging(settings)
    if args.command in TRACED:
        tracing.start()  # a no-op unless an OTLP endpoint is set (docs/tracing.md)
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
            tracing.log_ids,
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
            with tracing.producer("darkroom.ingest", photo_id=str(photo_id), lane=args.lane) as tc:
                parent = tc.get("traceparent")
                await store_lanes.insert_photo(pool, photo_id, key, args.lane, tenant, cost, parent)
                if args.lane == "interactive":  # bulk: the feeder XADDs it
                    await streams.enqueue(task_fields(photo_id, tc))
            progress.advance()
            progress.line(str(photo_id), sys.stdout)
        progress.finish()
    return 0


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".")
    return cleaned[:120] or "original"


async def cmd_enqueue(settings: Settings, args: argparse.Namespace) -> int:
    if args.rerender or args.state or args.since:
        return await acts.cmd_rerender(settings, args)
    if not args.photo_ids:
        print("darkroom: enqueue needs PHOTO_ID...", file=sys.stderr)
        return 2
    return await acts.cmd_enqueue(settings, args)


# glibc's mallopt parameter for the number of malloc arenas
_M_ARENA_MAX = -8


def _limit_arenas() -> None:
    """Two malloc arenas for the worker, as for its render processes: by default every
    thread that allocates (storage writes, the pipe's encodes) gets an arena of its own,
    up to 8 per core, and each keeps the photo bytes it freed (about 15 MB more resident
    under load, docs/performance.md, "Peak memory")."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 2)


async def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    _limit_arenas()
    # in a child: the worker keeps none of the decoders and memory the samples brought in
    checks = await anyio.to_thread.run_sync(isolated, selfcheck.run, settings.renditions)
    failed = selfcheck.failures(checks)
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


# The commands that make spans: the worker, and the producers.
TRACED = frozenset({"run", "ingest", "enqueue"})

COMMANDS = {
    "check": cmd_check,
    "migrate": cmd_migrate,
    "ingest": cmd_ingest,
    "enqueue": cmd_enqueue,
    "run": cmd_run,
    "status": ops.cmd_status,
    "photos": history.cmd_photos,
    "dlq": acts.cmd_dlq,
    "retry": acts.cmd_retry,
    "consumers": acts.cmd_consumers,
    "gc": gc.cmd_gc,
    "web": web.cmd_web,
    "attempts": history.cmd_attempts,
    "events": events_command.cmd_events,
    "audit": audit.cmd_audit,
    **bulk_commands.COMMANDS,
    **pause.COMMANDS,
    "limits": limits.cmd_limits,
    "erase": erase.cmd_erase,
}
