"""Pure: the throughput chart of the web page, drawn as inline SVG (no chart library).

One bar per time bucket, processed photos stacked under failed ones, with the peak and
the two ends of the time axis labelled. Imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Literal

Bucket = Literal["minute", "hour"]
STEP = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1)}
WIDTH, HEIGHT, PAD_LEFT, PAD_BOTTOM, PAD_TOP = 640, 160, 36, 18, 8


def truncate(moment: datetime, bucket: Bucket) -> datetime:
    moment = moment.replace(second=0, microsecond=0)
    return moment.replace(minute=0) if bucket == "hour" else moment


def fill(
    now: datetime, rows: Iterable[tuple[datetime, int, int]], bucket: Bucket, count: int
) -> list[tuple[datetime, int, int]]:
    """`count` consecutive buckets ending with the one holding `now`; absent ones are 0."""
    seen = {start: (processed, failed) for start, processed, failed in rows}
    last = truncate(now, bucket)
    starts = [last - STEP[bucket] * i for i in range(count - 1, -1, -1)]
    return [(s, *seen.get(s, (0, 0))) for s in starts]


def svg(buckets: list[tuple[datetime, int, int]], bucket: Bucket, title: str) -> str:
    peak = max((p + f for _, p, f in buckets), default=0) or 1
    plot_w, plot_h = WIDTH - PAD_LEFT, HEIGHT - PAD_BOTTOM - PAD_TOP
    slot = plot_w / max(len(buckets), 1)
    bars: list[str] = []
    for i, (start, processed, failed) in enumerate(buckets):
        x = PAD_LEFT + i * slot
        h_ok, h_bad = plot_h * processed / peak, plot_h * failed / peak
        base = PAD_TOP + plot_h
        label = f"{start:%H:%M} UTC: {processed} processed, {failed} failed"
        bars.append(
            f"<g><title>{label}</title>"
            f'<rect class="ok" x="{x:.1f}" y="{base - h_ok:.1f}" width="{slot * 0.8:.1f}" '
            f'height="{h_ok:.1f}"/>'
            f'<rect class="bad" x="{x:.1f}" y="{base - h_ok - h_bad:.1f}" '
            f'width="{slot * 0.8:.1f}" height="{h_bad:.1f}"/></g>'
        )
    return _frame(buckets, bucket, title, peak, "".join(bars))


def _frame(
    buckets: list[tuple[datetime, int, int]], bucket: Bucket, title: str, peak: int, bars: str
) -> str:
    fmt = "%H:%M" if bucket == "minute" else "%d %H:00"
    first = f"{buckets[0][0]:{fmt}}" if buckets else ""
    last = f"{buckets[-1][0]:{fmt}} UTC" if buckets else ""
    axis_y = HEIGHT - PAD_BOTTOM
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'xmlns="http://www.w3.org/2000/svg" aria-label="{title}">'
        f"<title>{title}</title>"
        f'<line class="axis" x1="{PAD_LEFT}" y1="{axis_y}" x2="{WIDTH}" y2="{axis_y}"/>'
        f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 10}" text-anchor="end">{peak}</text>'
        f'<text x="{PAD_LEFT - 4}" y="{axis_y}" text-anchor="end">0</text>'
        f'<text x="{PAD_LEFT}" y="{HEIGHT - 4}">{first}</text>'
        f'<text x="{WIDTH}" y="{HEIGHT - 4}" text-anchor="end">{last}</text>'
        f"{bars}</svg>"
    )
