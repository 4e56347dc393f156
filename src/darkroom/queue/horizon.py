"""Which interactive rows the PostgreSQL intake may enqueue without duplicating a producer's
own XADD: the delivery horizon. Pure (no I/O; times are handed in).

A producer that inserts and XADDs leaves `enqueued_at` NULL until a worker claims its
entry, so "NULL" cannot tell a row nobody XADDed from one whose entry waits behind a
backlog. A mark can: PostgreSQL's `now()` (`taken_at`), then, after it, the stream's last
generated id (`last_id`). A producer XADDs within INTAKE_GRACE_MS of its row's `created_at`,
so every row created before `taken_at - grace` that was XADDed at all has an entry at or
before `last_id`. Once the group has delivered past `last_id` (the first undelivered entry
comes after it, or there is none) the mark is ripe, and once a ripe mark has been seen so
for the claim grace, every such entry's claim has set `enqueued_at`: a row of that age still
NULL was never XADDed. Each comparison stays in one clock: PostgreSQL times with
PostgreSQL times, entry ids with entry ids, the local clock with itself, so the skew
between Redis and PostgreSQL does not matter. See docs/fairness.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

# A producer that inserts and XADDs does so within this of its row's created_at; the
# intake counts its entry among those XADDed before a mark only for rows this much older.
INTAKE_GRACE_MS = 250
# Unripe marks kept while a backlog lasts; past it, every other one is dropped (a coarser
# horizon is a later one, never a duplicate).
MAX_MARKS = 256

EntryId = tuple[int, int]


def entry_id(text: str) -> EntryId:
    """`1700000000000-3` as a comparable pair."""
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Mark:
    taken_at: datetime  # PostgreSQL's now(), read before the stream
    last_id: EntryId  # the stream's last generated id, read after it
    seen: float  # local clock, when taken
    ripe_at: float | None = None  # local clock: first seen delivered past `last_id`


class Horizon:
    """The marks of one feeder's tenure; `bound` answers the newest usable one."""

    def __init__(self, claim_grace_s: float) -> None:
        self.claim_grace_s = claim_grace_s
        self.marks: list[Mark] = []

    def observe(
        self, taken_at: datetime, last_id: str, undelivered: str | None, now: float
    ) -> None:
        """A new mark, and what the group has delivered: `undelivered` is the id of the
        first entry it has not (None: none waits)."""
        self.marks.append(Mark(taken_at, entry_id(last_id), now))
        first = entry_id(undelivered) if undelivered is not None else None
        for mark in self.marks:
            if mark.ripe_at is None and (first is None or mark.last_id < first):
                mark.ripe_at = now
        if len(self.marks) > MAX_MARKS:
            self.marks = self.marks[:-1:2] + self.marks[-1:]

    def bound(self, now: float) -> Mark | None:
        """The newest mark ripe for the claim grace (None: none yet); the marks before it
        are forgotten."""
        usable = [i for i, m in enumerate(self.marks) if self._usable(m, now)]
        if not usable:
            return None
        del self.marks[: usable[-1]]
        return self.marks[0]

    def next_usable(self, now: float) -> float | None:
        """When the next ripe mark becomes usable (None: none is waiting for its grace)."""
        waiting = [m.ripe_at for m in self.marks if m.ripe_at is not None and
                   not self._usable(m, now)]  # fmt: skip
        return min(waiting) + self.claim_grace_s if waiting else None

    def _usable(self, mark: Mark, now: float) -> bool:
        return mark.ripe_at is not None and now >= mark.ripe_at + self.claim_grace_s
