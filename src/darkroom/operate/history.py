"""One photo as operators look at it (its row, its facts, its attempt timeline) for
`darkroom photos show`, the photo page and /api/photos/<id>; and `darkroom attempts`, the
search over every delivery's row. The page and the commands share `photo_report`."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import msgspec

from darkroom.operate import facts, ops
from darkroom.services import services
from darkroom.settings import Settings
from darkroom.store import db, history, views


async def photo_report(pool: db.Pool, photo_id: uuid.UUID) -> dict[str, Any] | None:
    """The photo's row and job, `facts` (stored and readable) and `attempts` (oldest
    first); None for no such photo. Three indexed reads by primary key or photo id."""
    row = await views.photo_detail(pool, photo_id)
    if row is None:
        return None
    stored = await history.facts(pool, photo_id) or {}
    renditions = row["renditions"]
    return {
        **row,
        "renditions": msgspec.json.decode(renditions) if renditions else [],
        "facts": facts.readable(stored),
        "attempts": await history.timeline(pool, photo_id),
    }


async def cmd_photos(settings: Settings, args: argparse.Namespace) -> int:
    """`photos` lists (ops.cmd_photos); `photos show ID` shows one."""
    if args.action is None:
        return await ops.cmd_photos(settings, args)
    if args.photo_id is None:
        print("darkroom: photos show needs a PHOTO_ID", file=sys.stderr)
        return 2
    async with services(settings, 1) as (pool, _):
        report = await photo_report(pool, args.photo_id)
    if report is None:
        print(f"darkroom: no photo {args.photo_id}", file=sys.stderr)
        return 1
    print(_json(report) if args.json else format_report(report))
    return 0


def format_report(report: dict[str, Any]) -> str:
    f = report["facts"]
    size = f"{report['width']}x{report['height']}" if report["width"] else "-"
    lines = [
        f"photo       {report['id']}  {report['processing_state']}",
        f"original    {report['original_key']}  {report['format'] or '-'}  {size}  "
        f"{report['bytes'] or 0} bytes",
        *(f"{label:<12}{_shown(f.get(key))}" for label, key in FACT_LINES),
        "attempts",
        *(f"  {attempt_line(a)}" for a in report["attempts"]),
    ]
    return "\n".join(lines)


FACT_LINES = (
    ("taken", "taken"), ("camera", "camera"), ("lens", "lens_model"),
    ("exposure", "exposure_text"), ("sha256", "original_sha256"), ("alpha", "has_alpha"),
    ("frames", "frames"), ("profile", "source_profile"), ("thumbhash", "thumbhash"),
    ("dominant", "dominant_color"), ("hdr", "hdr"),
)  # fmt: skip


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def attempt_line(a: dict[str, Any]) -> str:
    """started, outcome, the four stage times, peak RSS, where, and the error."""
    stages = "/".join(_ms(a[f"{stage}_ms"]) for stage in history.STAGES)
    rss = f"{a['peak_rss_mb']:.0f}MB" if a["peak_rss_mb"] else "-"
    started = a["started_at"].isoformat(sep=" ", timespec="milliseconds")
    error = f"  {a['error_code']}: {(a['error'] or '')[:80]}" if a["error_code"] else ""
    return (f"{started}  {a['outcome']:<11}  {stages:<20}  {rss:>6}  {a['lane'] or '-':<11}  "
            f"{a['entry_id']}  {a['consumer']}{error}")  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


async def cmd_attempts(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings, 1) as (pool, _):
        rows = await history.search(pool, args.code, args.since, args.consumer, args.limit)
    if args.json:
        print(_json(rows))
        return 0
    print("photo  started  outcome  download/render/upload/publish ms  peak RSS  lane  entry  "
          "consumer  error")  # fmt: skip
    for row in rows:
        print(f"{row['photo_id'] or '(no photo)'}  {attempt_line(row)}")
    print(f"{len(rows)} attempt(s), newest first", file=sys.stderr)
    return 0


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()
