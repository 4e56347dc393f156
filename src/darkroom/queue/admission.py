"""Pure admission between the lanes: how many new entries to read from each lane now.

Interactive owns the reserved places and may use every regular place; bulk uses the
regular places interactive does not hold (work conserving) and keeps `floor` of them under
sustained interactive load. Entries already held keep their places; nothing is preempted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Places:
    """In-flight places of one worker: `regular` for both lanes, `reserved` for interactive
    alone, and `floor` regular places bulk keeps while it has work waiting."""

    regular: int
    reserved: int
    floor: int

    @classmethod
    def of(cls, regular: int, reserved: int, floor_share: float) -> Places:
        """`floor_share` of the regular places, rounded up: any share above 0 keeps ≥ 1."""
        floor = min(regular, math.ceil(floor_share * regular - 1e-9)) if floor_share > 0 else 0
        return cls(regular, reserved, floor)


@dataclass(frozen=True)
class Reads:
    """New entries to read now from each lane; their sum never exceeds the free places."""

    interactive: int
    bulk: int

    def lanes(self) -> list[str]:
        return [lane for lane, n in (("interactive", self.interactive), ("bulk", self.bulk)) if n]


def free_regular(places: Places, interactive: int, bulk: int) -> int:
    """Regular places nobody holds: interactive fills its reserved places first."""
    return max(0, places.regular - bulk - max(0, interactive - places.reserved))


def interactive_room(places: Places, interactive: int, bulk: int, bulk_waiting: bool) -> int:
    """Free reserved places, plus the free regular ones bulk's floor does not keep (it keeps
    them only while bulk has work waiting, so an idle bulk lane costs interactive nothing)."""
    regular = free_regular(places, interactive, bulk)
    kept = min(regular, max(0, places.floor - bulk)) if bulk_waiting else 0
    return max(0, places.reserved - interactive) + regular - kept


def bulk_room(places: Places, interactive: int, bulk: int) -> int:
    """Bulk may fill every regular place interactive does not hold (work conserving)."""
    return free_regular(places, interactive, bulk)


def blocking_reads(places: Places, interactive: int, bulk: int) -> Reads:
    """Both lanes came back empty: block for one entry of each lane that has room, never
    more than the free places (one XREADGROUP over both streams takes COUNT from each).
    With one place left, interactive alone: bulk waits at most one block for it."""
    free = interactive_room(places, interactive, bulk, bulk_waiting=False)
    b_room = bulk_room(places, interactive, bulk)
    if free >= 2 and b_room:
        return Reads(1, 1)
    return Reads(min(1, free), 0)
