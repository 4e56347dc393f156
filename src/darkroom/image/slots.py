"""The render pool's free slots (image/renderer.py owns the one `Slots`): which kind a photo
may take, and the wait for one.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

# With reserved slots, the regular slots' processes run this much nicer: under a full bulk
# load the CPU goes first to the worker's own loop and to an upload's render.
REGULAR_NICE = 5


@dataclass
class Slots:
    """Free render slots: `regular` for any photo, `reserved` for interactive ones alone.
    An interactive photo takes a reserved slot first (its process is not the nicer one), so
    regular ones stay bulk's. While no bulk renders, interactive photos render at most as
    many at once as there are regular slots (cores): more would each be slower, none
    sooner, and none of them waits behind bulk."""

    regular: int
    reserved: int
    bulk: int = 0  # regular slots held by bulk renders
    interactive: int = 0  # slots of either kind held by interactive renders
    _changed: anyio.Event | None = None  # made on first wait: inside the event loop

    def __post_init__(self) -> None:
        self.regular_total = self.regular

    def _kinds(self, interactive: bool) -> tuple[str, ...]:
        if not interactive:
            return ("regular",)
        if not self.bulk and self.interactive >= self.regular_total:
            return ()
        return ("reserved", "regular")

    def _take(self, interactive: bool) -> str | None:
        for kind in self._kinds(interactive):
            if getattr(self, kind):
                setattr(self, kind, getattr(self, kind) - 1)
                self.bulk += not interactive
                self.interactive += interactive
                return kind
        return None

    async def acquire(self, interactive: bool) -> str:
        while (kind := self._take(interactive)) is None:
            self._changed = self._changed or anyio.Event()
            await self._changed.wait()
        if not interactive:
            self._wake()  # an interactive photo waiting may take a reserved slot now
        return kind

    def release(self, kind: str, interactive: bool) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.bulk -= not interactive
        self.interactive -= interactive
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
