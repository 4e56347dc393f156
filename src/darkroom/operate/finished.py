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
    # hour start -> the sums of its kept minutes, kept as minutes come and go: summing a
    # day of minutes on every refresh cost 2 ms of the web process's CPU per snapshot
    sums: dict[datetime, tuple[int, int]] = field(default_factory=dict)

    async def charts(self, pool: db.Pool) -> tuple[Buckets, Buckets]:
        """(per minute over the last hour, per hour over the last day), 0 where none."""
        now, rows = await views.throughput(pool, "minute", DAY.total_seconds(), self.settled)
        self.merge(now, rows)
        return chart.fill(now, self.series(now), "minute", 60), chart.fill(
            now, self.hours(), "hour", 24
        )

    def merge(self, now: datetime, rows: Buckets) -> None:
        """Pure: the rows read from `settled` on replace those minutes; a day's worth kept."""
        if self.settled is not None:
            for start in [m for m in self.minutes if m >= self.settled]:
                self._drop(start)
        for start, p, f in rows:
            self._drop(start)
            self._keep(start, (p, f))
        for start in [m for m in self.minutes if m < now - DAY - timedelta(hours=1)]:
            self._drop(start)
        self.settled = chart.truncate(now - SETTLE, "minute")

    def _keep(self, start: datetime, counts: tuple[int, int]) -> None:
        self.minutes[start] = counts
        self._add(start, counts, 1)

    def _drop(self, start: datetime) -> None:
        counts = self.minutes.pop(start, None)
        if counts is not None:
            self._add(start, counts, -1)

    def _add(self, start: datetime, counts: tuple[int, int], sign: int) -> None:
        hour = chart.truncate(start, "hour")
        p, f = self.sums.get(hour, (0, 0))
        summed = (p + sign * counts[0], f + sign * counts[1])
        if summed == (0, 0) and sign < 0:
            self.sums.pop(hour, None)
        else:
            self.sums[hour] = summed

    def series(self, now: datetime) -> Buckets:
        """The minutes of the last hour (the chart shows no more)."""
        since = chart.truncate(now, "minute") - timedelta(hours=1)
        return [(start, p, f) for start, (p, f) in self.minutes.items() if start > since]

    def hours(self) -> Buckets:
        return [(start, p, f) for start, (p, f) in sorted(self.sums.items())]
