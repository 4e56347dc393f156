"""The audit trail on the page (`/audit`) and as JSON (`/api/audit`): who acted, through
what, on which selection and how it ended, newest first, one keyset page at a time
(store/audit.py reads it), filtered by action and by time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from darkroom.operate.web.pages import MAX_PAGE_SIZE, page_size
from darkroom.operate.web.render import deps, json_response, render
from darkroom.store import audit

AUDIT_PAGE_SIZE = 50
ACTION_MAX_CHARS = 100
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def parse_since(raw: str | None) -> datetime | None:
    """An ISO 8601 time; one without a zone is UTC, as `darkroom audit --since` reads it."""
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise HTTPException(400, "since must be an ISO 8601 time, e.g. 2026-12-01T09:00") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def cursor_of(row: dict[str, Any]) -> str:
    """`before` for the page after this row: its time in microseconds since the epoch and
    its id (`<us>_<id>`, nothing a URL must escape)."""
    return f"{(row['at'] - EPOCH) // MICROSECOND}_{row['id']}"


def parse_cursor(raw: str | None) -> tuple[datetime, int] | None:
    if not raw:
        return None
    at_us, _, row_id = raw.partition("_")
    if not (at_us.isascii() and at_us.isdigit() and row_id.isascii() and row_id.isdigit()):
        raise HTTPException(400, "bad page cursor")
    try:
        return EPOCH + int(at_us) * MICROSECOND, int(row_id)
    except (OverflowError, ValueError):  # past datetime's range; more digits than int() reads
        raise HTTPException(400, "bad page cursor") from None


def parse_action(raw: str | None) -> str | None:
    action = (raw or "").strip() or None
    if action is not None and len(action) > ACTION_MAX_CHARS:
        raise HTTPException(400, f"action is at most {ACTION_MAX_CHARS} characters")
    return action


async def audit_page_data(request: Request) -> dict[str, Any]:
    """One page of rows and the cursor of the next (None: this is the last)."""
    q = request.query_params
    action, since = parse_action(q.get("action")), parse_since(q.get("since"))
    size = page_size(q.get("limit"), AUDIT_PAGE_SIZE)
    rows = await audit.since(deps(request).pool, since, size + 1, action,
                             parse_cursor(q.get("before")))  # fmt: skip
    more, rows = len(rows) > size, rows[:size]
    cursor = cursor_of(rows[-1]) if more else None
    return {"actions": rows, "next": cursor, "limit": size, "action": action,
            "since": since.isoformat() if since else None}  # fmt: skip


async def audit_list(request: Request) -> Response:
    page = await audit_page_data(request)
    return render(request, "audit.html", rows=page["actions"], action=page["action"],
                  since=request.query_params.get("since") or "", cursor=page["next"],
                  limit=page["limit"], max_limit=MAX_PAGE_SIZE)  # fmt: skip


async def api_audit(request: Request) -> Response:
    return json_response(await audit_page_data(request))
