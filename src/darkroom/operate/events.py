"""`darkroom events [--since ID|TIME] [--follow] [--json]`: photo events replayed from
PostgreSQL (photo_events) in publication order, so a consumer that was away catches up; with
--follow it keeps printing new ones as they commit (LISTEN, then a catch-up query).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio

from darkroom.settings import Settings
from darkroom.store import outbox

PAGE = 500
# A row id skipped by a later one belongs to a transaction still committing (ids are taken
# before the commit) or one rolled back: looked for again for this long, then given up.
GAP_WAIT_S = 30.0
# A larger hole is not commits in flight (retention, a replay's start, a bulk rollback).
MAX_GAP = 100
FOLLOW_IDLE_S = 1.0  # without a NOTIFY, how often the gaps are looked at again


def parse_since(raw: str) -> uuid.UUID | datetime:
    """An event's CloudEvents `id` (replay after it) or an ISO 8601 time (replay from it;
    UTC unless it says otherwise)."""
    try:
        return uuid.UUID(raw)
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is neither an event id nor a time") from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


@dataclass
class Cursor:
    """Pure: where a replay stands. `after` is the highest row printed; `gaps` are lower
    ids not seen yet (id → when first missed), still worth a look for GAP_WAIT_S."""

    after: int = 0
    gaps: dict[int, float] = field(default_factory=dict)

    def take(self, seqs: list[int], now_s: float) -> None:
        for seq in seqs:
            self.gaps.pop(seq, None)
            if seq - self.after <= MAX_GAP:
                self.gaps |= {gap: now_s for gap in range(self.after + 1, seq)}
            self.after = max(self.after, seq)
        self.gaps = {g: t for g, t in self.gaps.items() if now_s - t < GAP_WAIT_S}


def line(event: outbox.Event, source: str, as_json: bool) -> str:
    if as_json:
        return json.dumps(outbox.envelope(event, source))
    code = event.data.get("error_code") or ""
    if event.type.startswith("darkroom.queue."):  # about a paused scope, not a photo
        data = event.data
        tenant = "*" if data.get("tenant") is None else data["tenant"]
        code = f"lane={data.get('lane') or '*'} tenant={tenant}  by {data.get('operator')}"
        return f"{event.created_at.isoformat()}  {event.type:<31}  {code}"
    return f"{event.created_at.isoformat()}  {event.type:<31}  {event.photo_id}  {code}".rstrip()


async def cmd_events(settings: Settings, args: argparse.Namespace) -> int:
    wake = anyio.Event()

    def notified(payload: str | None) -> None:
        wake.set()

    async with outbox.listening(settings.database_url, notified) as conn:
        cursor = Cursor(await _start(conn, args.since))
        if cursor.after < 0:
            print(f"darkroom: no event {args.since} (past retention?)", file=sys.stderr)
            return 2
        while True:
            wake = anyio.Event()  # LISTEN is on: what commits from here wakes the next turn
            await _print_new(conn, cursor, settings.events_source_uri, args.json)
            if not args.follow:
                return 0
            with anyio.move_on_after(FOLLOW_IDLE_S):
                await wake.wait()


async def _start(conn: outbox.Conn, since: uuid.UUID | datetime | None) -> int:
    """The row after which the replay starts; -1 for an event id that is not there."""
    if since is None:
        return 0
    if isinstance(since, uuid.UUID):
        seq = await outbox.seq_of(conn, since)
        return -1 if seq is None else seq
    return await outbox.seq_before(conn, since)


async def _print_new(conn: outbox.Conn, cursor: Cursor, source: str, as_json: bool) -> None:
    late = await outbox.by_seqs(conn, sorted(cursor.gaps)) if cursor.gaps else []
    _emit(late, cursor, source, as_json)
    while page := await outbox.after(conn, cursor.after, PAGE):
        _emit(page, cursor, source, as_json)


def _emit(events: list[outbox.Event], cursor: Cursor, source: str, as_json: bool) -> None:
    for event in events:
        print(line(event, source, as_json), flush=True)
    cursor.take([e.seq for e in events], time.monotonic())
