"""Operator commands and the operations behind them: status, photos, dead letters
(list/replay), retry, re-enqueue and consumer pruning. The command line (its
state-changing commands in operate/acts.py) and the web page share the operations here,
so both change state the same way."""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from darkroom.operate import pause
from darkroom.queue.messages import Entry, task_fields
from darkroom.queue.streams import Streams
from darkroom.services import services
from darkroom.settings import Settings, servers
from darkroom.store import db, duties, intake, limits, pauses, views
from darkroom.store import lanes as store_lanes

# What a bulk (re-)enqueue prints instead of an entry id: the feeder enqueues it.
FED = "feeder"
# Why a bulk photo was not handed to the feeder (to_feeder takes only an unfinished photo).
NOT_FEEDABLE = (
    "not handed to the feeder: no such photo, or it is finished (a processed photo is "
    "re-rendered by `enqueue --rerender`, a failed one retried by `darkroom retry`)"
)


@dataclass(frozen=True)
class Skipped:
    """A dead letter nothing was enqueued for, and why (shown to the operator)."""

    why: str


NO_PHOTO_ID = Skipped("no photo_id; the letter stays")
TAKEN = Skipped("another replay took it")
NOT_FAILED = Skipped(
    "its photo is gone, processed, or sent back already (by another letter of it, or a "
    "retry); the letter stays"
)
GONE_OR_DONE = Skipped("its bulk photo is gone, or processed since; the letter stays")

# A consumer idle longer than this is marked in `status` and pruned by default (1 h).
IDLE_BOUND_MS = 3_600_000
ESTIMATED = " (estimated from the planner's statistics: more photos than a count reads)"
PAGE = 500


async def status_report(pool: db.Pool, streams: Streams) -> dict[str, Any]:
    by_state, failures, estimated = await views.counts(pool)
    report = {**await streams.status(), "photos": by_state, "failures": failures,
              "photos_estimated": estimated,
              "duties": await duties.holders(pool), "leased": await views.leased(pool),
              "limits": await limits.listed(pool),
              "pauses": await pauses.active(pool)}  # fmt: skip
    mark_idle(report["consumers"])
    for lane in report["lanes"].values():
        lane["oldest_wait_s"] = oldest_wait_s(lane["oldest_entry_ms"], time.time())
    return report


def oldest_wait_s(oldest_ms: int | None, now_s: float) -> float | None:
    """How long a lane's oldest entry has waited (a clock behind Redis's reads 0)."""
    return None if oldest_ms is None else round(max(0.0, now_s - oldest_ms / 1000), 1)


def mark_idle(consumers: list[dict[str, Any]], bound_ms: int = IDLE_BOUND_MS) -> None:
    for consumer in consumers:
        consumer["idle_past_bound"] = consumer["idle_ms"] > bound_ms


async def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, streams):
        report = {"servers": servers(settings), **await status_report(pool, streams),
                  "tenant_rate_per_s": settings.tenant_rate}  # fmt: skip
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(_format_status(report))
    return 0


def _format_status(report: dict[str, Any]) -> str:
    stale = "  idle over 1 h: `darkroom consumers prune` removes it once nothing is pending"
    lines = [
        *(f"{name:<14}{where}" for name, where in report.get("servers", {}).items()),
        f"stream        {report['stream']}  length={report['length']}",
        f"group         {report['group']}  lag={report['lag']}  pending={report['pending']}",
        f"dead letters  {report['dead_letter_stream']}  length={report['dead_letters']}",
        "lanes",
        *(f"  {lane:<12} {v['stream']}  length={v['length']}  lag={v['lag']}  "
          f"pending={v['pending']}  oldest_wait_s={_or_dash(v.get('oldest_wait_s'))}"
          for lane, v in report.get("lanes", {}).items()),
        "paused (no new photo of these scopes starts; in progress finish)",
        *(f"  {pause.describe(p)}" for p in report.get("pauses", [])),
        *([] if report.get("pauses") else ["  nothing"]),
        "consumers",
        *(f"  {c['name']:<40} pending={c['pending']:<6} idle_ms={c['idle_ms']}"
          + (stale if c["idle_past_bound"] else "") for c in report["consumers"]),
        "rendering now (held by live job leases)",
        *(f"  {r['lane']:<12} {r['tenant'] or '-':<20} {r['n']}" for r in report.get("leased", [])),
        f"rate limits (own; other tenants: {report.get('tenant_rate_per_s') or 0:g}/s, 0 none)",
        *(f"  {lim['tenant']:<20} {lim['shown']:<10} burst={lim['burst']}"
          + ("  interactive too" if lim["interactive"] else "")
          for lim in report.get("limits", [])),
        "duties (single runners: who holds each lease, since when, until when)",
        *(_duty_line(d) for d in report.get("duties", [])),
        "photos by state" + (ESTIMATED if report.get("photos_estimated") else ""),
        *(f"  {state:<20} {n}" for state, n in report["photos"].items()),
        "failures by error code",
        *(f"  {code:<20} {n}" for code, n in report["failures"].items()),
    ]  # fmt: skip
    return "\n".join(lines)


def _or_dash(value: object) -> str:
    """A missing number as the page shows it: a dash, never `None`."""
    return "-" if value is None else str(value)


def _duty_line(duty: dict[str, Any]) -> str:
    left = duty["expires_in_s"]
    until = f"expires_in_s={left}" if left > 0 else "expired (free to take)"
    return (f"  {duty['name']:<14} {duty['holder']:<40} token={duty['token']:<5} "
            f"since={duty['since'].isoformat(timespec='seconds')}  {until}")  # fmt: skip


async def cmd_photos(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, _):
        rows = await views.list_photos(pool, args.state, args.limit)
    if args.json:
        print(msgspec.json.encode(rows).decode())
        return 0
    header = f"{'photo_id':<36}  {'state':<17}  {'format':<6}  {'size':>11}  {'bytes':>9}  "
    print(header + "renditions  attempt  lane         tenant      error_code")
    for r in rows:
        size = f"{r['width']}x{r['height']}" if r["width"] else "-"
        print(f"{r['id']!s:<36}  {r['processing_state']:<17}  {r['format'] or '-':<6}  "
              f"{size:>11}  {r['bytes'] or 0:>9}  {r['renditions']:>10}  {r['attempt']:>7}  "
              f"{r['lane']:<11}  {r['tenant'] or '-':<10}  {r['error_code'] or ''}")  # fmt: skip
    return 0


# -- dead letters ---------------------------------------------------------------------------


async def dead_letters(
    streams: Streams, codes: list[str] | None, limit: int | None
) -> AsyncIterator[Entry]:
    """Dead letters oldest first, page by page, only these codes (None: all), at most `limit`."""
    after, seen = "-", 0
    while limit is None or seen < limit:
        page = await streams.dead_letter_page(after, PAGE)
        for letter in page:
            if not codes or letter.fields.get("error_code") in codes:
                yield letter
                seen += 1
                if limit is not None and seen >= limit:
                    return
        if len(page) < PAGE:
            return
        after = page[-1].id


@dataclass(frozen=True)
class LetterPage:
    """One page of dead letters. `after` is where the next page starts (None: the stream
    ends here); `partial` says the scan bound ended the page before it filled."""

    letters: list[Entry]
    scanned: int
    after: str | None
    partial: bool


async def letter_page(
    streams: Streams, code: str | None, after: str, limit: int, scan_max: int
) -> LetterPage:
    """At most `limit` letters after id `after`, oldest first, with this code (None: all).
    One XRANGE of at most `scan_max` entries: a filter never walks the whole stream."""
    count = scan_max if code else limit
    entries = await streams.dead_letter_page(after, count)
    letters, used = pick_letters(entries, code, limit)
    at_end = used == len(entries) < count
    cursor = None if at_end else entries[used - 1].id
    return LetterPage(letters, used, cursor, partial=not at_end and len(letters) < limit)


def pick_letters(entries: list[Entry], code: str | None, limit: int) -> tuple[list[Entry], int]:
    """The first `limit` entries with this code (None: any), and how many entries were
    read to find them (the next page starts after the last one read)."""
    picked: list[Entry] = []
    for used, entry in enumerate(entries, 1):
        if code is None or entry.fields.get("error_code") == code:
            picked.append(entry)
            if len(picked) == limit:
                return picked, used
    return picked, len(entries)


async def replay_letter(pool: db.Pool, streams: Streams, letter: Entry) -> str | Skipped:
    """Reset the photo to `uploaded`, then move the letter back onto the work stream in one
    script (so never twice, even by two replays at once). Only a failed photo is enqueued:
    a second letter of a photo another letter (or `retry`) already sent back would put a
    second entry beside the first. The new entry id (FED for a bulk letter), or why
    nothing was enqueued."""
    raw = letter.fields.get("photo_id")
    try:
        photo_id = uuid.UUID(raw or "")
    except ValueError:
        return NO_PHOTO_ID
    if not await db.reset_failed(pool, photo_id):
        return NOT_FAILED
    if letter.fields.get("lane") == "bulk":
        return await _replay_to_feeder(pool, streams, letter.id, photo_id)
    fields = task_fields(photo_id, letter.fields)  # the letter kept the entry's trace context
    new_id = await streams.for_lane("interactive").replay_once(letter.id, fields)
    if new_id is None:
        return TAKEN
    await db.record_requeued(pool, photo_id, new_id)
    return new_id


async def _replay_to_feeder(
    pool: db.Pool, streams: Streams, dead_id: str, photo_id: uuid.UUID
) -> str | Skipped:
    """A bulk letter goes back through the feeder. The photo first: a letter whose photo
    the feeder does not take (gone, or processed since) stays. Then the letter is taken
    once; of two replays at once, the loser's hand-over only repeats the winner's (at
    worst a duplicate entry, which ends `busy` or `already`)."""
    if not await store_lanes.to_feeder(pool, photo_id):
        return GONE_OR_DONE
    return FED if await streams.take_letter(dead_id) else TAKEN


async def retry_photo(pool: db.Pool, streams: Streams, photo_id: uuid.UUID) -> str | None:
    """A failed photo is terminal until an operator retries it: reset, then XADD. None if
    the photo was not `processing_failed` (left alone), or was deleted meanwhile."""
    if not await db.reset_failed(pool, photo_id):
        return None
    await streams.ensure_group()
    return await enqueue_again(pool, streams, photo_id)


async def enqueue_again(
    pool: db.Pool,
    streams: Streams,
    photo_id: uuid.UUID,
    lane: str | None = None,
    tenant: str | None = None,
    carried: dict[str, str] | None = None,
) -> str | None:
    """Into the photo's own lane, or into `lane` (recorded in its row, with `tenant`).
    Interactive: XADD and remember the entry it now goes through (the sweeper and the
    owning-entry guards read it), the new entry id; bulk: to the feeder, FED, or None when
    the feeder does not take it (the photo is gone or finished): nothing was enqueued,
    and its lane and tenant are as they were. The entry carries the photo's trace context
    (its row's), else `carried` (the enqueue's own producer span)."""
    if (lane or await store_lanes.lane_of(pool, photo_id)) == "bulk":
        return FED if await store_lanes.to_feeder(pool, photo_id, tenant) else None
    if lane is not None or tenant is not None:
        await store_lanes.set_lane(pool, photo_id, lane, tenant)
    traced = await intake.prepare_jobs(pool, [photo_id])  # before the XADD, as the sweep does
    context = {"traceparent": traced[photo_id]} if photo_id in traced else carried
    entry_id = await streams.for_lane("interactive").enqueue(task_fields(photo_id, context))
    await db.record_requeued(pool, photo_id, entry_id)
    return entry_id


# -- consumers ------------------------------------------------------------------------------


async def prune_consumers(streams: Streams, idle_ms: int, dry_run: bool) -> list[str]:
    """Consumers with nothing pending idle longer than `idle_ms`: removed (or only named,
    on a dry run). The check and the delete are atomic in Redis (queue/streams/scripts.py)."""
    status = await streams.status()
    idle = [c["name"] for c in status["consumers"] if not c["pending"] and c["idle_ms"] > idle_ms]
    if dry_run:
        return idle
    return [name for name in idle if await streams.remove_consumer_if_idle(name, idle_ms)]
