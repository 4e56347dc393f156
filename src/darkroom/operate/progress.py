"""Progress of bulk commands (ingest, dlq replay): a bar on a terminal, one summary line
otherwise, and an optional rate cap.

The bar and the summary go to stderr, so stdout stays one result per line for scripts.
"""

from __future__ import annotations

import re
import time
from typing import TextIO

import anyio

BAR_WIDTH = 30
REDRAW_EVERY_S = 0.1
# A paced loop makes up at most this much lost time at once (Pacer).
CATCH_UP_S = 0.1


def parse_rate(text: str) -> float:
    """`N/s`, `N/m` or a bare `N` (per second), N > 0; raises ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*([sm]))?\s*", text)
    if not match or float(match[1]) <= 0:
        raise ValueError(f"rate must look like 50/s or 600/m, got {text!r}")
    return float(match[1]) / (60.0 if match[2] == "m" else 1.0)


class Progress:
    """Counts done items of `total`; `verb` names them in the output (\"replayed\")."""

    def __init__(self, total: int, verb: str, out: TextIO) -> None:
        self.total, self.verb, self.out = total, verb, out
        self.done = 0
        self.tty = out.isatty()
        self.started = self._drawn = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and (now - self._drawn >= REDRAW_EVERY_S or self.done >= self.total):
            self._drawn = now
            self.out.write(f"\r{self.bar()}")
            self.out.flush()

    def line(self, text: str, stdout: TextIO) -> None:
        """One result line on stdout, kept above the bar on a terminal."""
        if self.tty:
            self.out.write("\r\033[K")
            self.out.flush()
        print(text, file=stdout, flush=True)
        if self.tty:
            self.out.write(self.bar())
            self.out.flush()

    def bar(self) -> str:
        filled = BAR_WIDTH * self.done // self.total if self.total else BAR_WIDTH
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return f"[{bar}] {self.done}/{self.total} {self.rate():.1f}/s"

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.started, 1e-6)

    def finish(self, extra: str = "") -> None:
        if self.tty:
            self.out.write("\n")
        elapsed = time.monotonic() - self.started
        tail = f"; {extra}" if extra else ""
        self.out.write(
            f"{self.verb} {self.done} of {self.total} in {elapsed:.1f} s "
            f"({self.rate():.1f}/s){tail}\n"
        )
        self.out.flush()


class Pacer:
    """At most `per_s` calls of `wait()` per second, evenly spaced (None: no cap), on a
    schedule that counts the caller's own time: a bulk run waits once per photo, then acts
    on the group in one commit, and a pacer that restarted its spacing after each act lost
    that commit's time every group (100/s ran at 65/s on a machine that acted at 122/s).
    Time lost is made up for at most `catch_up_s`: after a longer stall the spacing starts
    afresh, so no call comes more than `catch_up_s` of the rate early."""

    def __init__(self, per_s: float | None, catch_up_s: float = CATCH_UP_S) -> None:
        self.interval_s = 1.0 / per_s if per_s else 0.0
        self.catch_up_s = catch_up_s
        self._next = time.monotonic()

    def delay(self, now: float) -> float:
        """Seconds the call at `now` waits; the schedule moves on by one interval."""
        if not self.interval_s:
            return 0.0
        due = max(self._next, now - self.catch_up_s)
        self._next = due + self.interval_s
        return max(0.0, due - now)

    async def wait(self) -> None:
        if delay := self.delay(time.monotonic()):
            await anyio.sleep(delay)
