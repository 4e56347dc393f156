"""How many bulk entries wait undelivered in the bulk stream (the feeder's reserve): every
live worker's regular places, so each place that frees finds an entry, or the entries the
workers take in AHEAD_S at the rate they take them now, whichever is more. Pure: the feeder
tells it what it fed and what it finds undelivered, with its clock's time.

The places alone made small batches when photos are quick: with 4 places a worker, the
feeder topped up 2 entries at a time (it tops up by halves), so tiny photos paid a feeding
turn (a pick, the fenced job rows, the XADDs, their marks, the workers' word) every second
photo, on the same event loop as their claims and publishes. Sized by the take rate, a
turn feeds what the workers take in AHEAD_S / 2. The fair order is decided at most AHEAD_S
before a photo is taken, as it was decided a few places before.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

AHEAD_S = 0.25
WINDOW_S = 2.0  # the take rate over the last this many seconds of looks
MOST = 1_000


@dataclass
class Reserve:
    ahead_s: float = AHEAD_S
    most: int = MOST
    _looks: deque[tuple[float, int]] = field(default_factory=deque)  # (when, taken so far)
    _taken: int = 0
    _fed: int = 0  # fed since the last look
    _undelivered: int | None = None  # at the last look
    _size: int = 0  # the last size given

    def fed(self, entries: int) -> None:
        self._fed += entries

    def look(self, now: float, undelivered: int) -> None:
        """The stream's undelivered entries now: what was taken since the last look is the
        last look's, plus what was fed since, less what is left."""
        if self._undelivered is not None:
            self._taken += max(0, self._undelivered + self._fed - undelivered)
        self._undelivered, self._fed = undelivered, 0
        self._looks.append((now, self._taken))
        while self._looks and self._looks[0][0] < now - WINDOW_S:
            self._looks.popleft()

    def rate(self) -> float:
        """Entries taken per second, over the whole window even when the looks span less:
        two looks milliseconds apart at the start of a busy spell (a resume, a takeover, a
        backlog after idle) would otherwise read a few takes as hundreds a second."""
        (_, first), (_, last) = self._looks[0], self._looks[-1]
        return (last - first) / WINDOW_S

    def size(self, places: int) -> int:
        """At least `places`, and at most twice the last size: entries that vanished
        undelivered (a Redis wipe) read as taken, and a reserve that followed them at once
        would feed seconds of work ahead of the fair order."""
        if not self._looks:
            return places
        wanted = max(places, min(self.most, math.ceil(self.rate() * self.ahead_s)))
        self._size = min(wanted, max(places, 2 * self._size))
        return self._size
