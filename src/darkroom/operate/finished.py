"""The overview's throughput charts (photos finished per minute over the last hour, per
hour over the last day) without reading a day of photos on every refresh: a minute that
has ended is read once and kept, each refresh reads only the photos finished since, and
the hours are the sums of their minutes. So a refresh costs the photos of the last minute
or two, whatever the day held; only the first load reads the whole day.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from darkroom.operate import chart
from darkroom.store import db, views

DAY = timedelta(days=1)
# A publish's processed_at is its transaction's start: it commits a little later, so a
# minute is settled (read for the last time) only this long after it ended.
SETTLE = timedelta(seconds=30)

Buckets = list[tuple[datetime, int, int]]


@dataclass
class Finished:
    # minute start -> (processed, failed), over the last day; minutes before `settled`
    # are final and not read again
    minutes: dict[datetime, tuple[int, int]] = field(default_factory=dict)
    settled: datetime | None = None

    async def charts(self, pool: db.Pool) -> tuple[Buckets, Buckets]:
        """(per minute over the last hour, per hour over the last day), 0 where none."""
        now, rows = await views.throughput(pool, "minute", DAY.total_seconds(), self.settled)
        self.merge(now, rows)
        return chart.fill(now, self.series(), "minute", 60), chart.fill(
            now, self.hours(), "hour", 24
        )

    def merge(self, now: datetime, rows: Buckets) -> None:
        """Pure: the rows read from `settled` on replace those minutes; a day's worth kept."""
        if self.settled is not None:
            for start in [m for m in self.minutes if m >= self.settled]:
                del self.minutes[start]
        self.minutes.update({start: (p, f) for start, p, f in rows})
        for start in [m for m in self.minutes if m < now - DAY - timedelta(hours=1)]:
            del self.minutes[start]
        self.settled = chart.truncate(now - SETTLE, "minute")

    def series(self) -> Buckets:
        return [(start, p, f) for start, (p, f) in sorted(self.minutes.items())]

    def hours(self) -> Buckets:
        summed: dict[datetime, tuple[int, int]] = {}
        for start, (p, f) in self.minutes.items():
            hour = chart.truncate(start, "hour")
            before = summed.get(hour, (0, 0))
            summed[hour] = (before[0] + p, before[1] + f)
        return [(start, p, f) for start, (p, f) in sorted(summed.items())]
