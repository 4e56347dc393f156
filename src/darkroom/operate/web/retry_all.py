"""The photos page's "retry all N matching": a confirm page showing the exact count of the
failed photos the page's filter (an error code, or none) matches, and the form behind the
token and CSRF that runs `darkroom bulk retry` over them, at most RETRY_ALL_MAX a post (a
second post continues the same action: operate/bulk.py)."""

from __future__ import annotations

import io

import structlog
from starlette.requests import Request
from starlette.responses import Response

from darkroom.operate import bulk
from darkroom.operate.progress import Progress
from darkroom.operate.web.actions import authorize, done
from darkroom.operate.web.render import deps, render
from darkroom.store import selection
from darkroom.store.selection import Selection

log = structlog.get_logger("darkroom.web")
RETRY_ALL_MAX = 1000  # photos retried per post; the page says when more remain


def _plan(code: str | None) -> bulk.Plan:
    plan = bulk.plan_of("retry", Selection(state="processing_failed", code=code), None, None)
    assert isinstance(plan, bulk.Plan)  # a state is always named
    return plan


async def confirm(request: Request) -> Response:
    code = request.query_params.get("code") or None
    count = await selection.count(deps(request).pool, _plan(code).where)
    return render(request, "retry_all.html", code=code, count=count, q=request.query_params)


async def retry_all(request: Request) -> Response:
    caller = await authorize(request)
    kind, form = caller.kind, caller.form
    d, code = deps(request), str(form.get("code") or "") or None
    plan = _plan(code)
    action = caller.action(bulk.action_name("retry"), plan.frozen())
    run = bulk.Run(action, plan, limit=RETRY_ALL_MAX)
    total, _ = await bulk.begin(d.pool, run)
    await d.streams.ensure_group()
    complete = await bulk.execute(d.pool, d.streams, run, Progress(total, "retried", io.StringIO()))
    counts = await bulk.finish(d.pool, run, complete)
    retried = counts.get("sent", 0) + counts.get("acted", 0)
    log.info("photos retried in bulk", via=kind, code=code, retried=retried, more=not complete)
    payload = {"retried": retried, "skipped": counts.get("skipped", 0), "total": total,
               "more": not complete, "action": str(run.action.action_id)}  # fmt: skip
    return done(kind, "/photos/retry-all", {**payload, **({"code": code} if code else {})})
