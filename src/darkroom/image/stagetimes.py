"""The stages of one render (decode, resize, each encode) as the render process timed them, on
the wall clock the worker's spans use: a traced worker shows them as children of its render
span, since the render process itself runs no tracing (docs/tracing.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import msgspec


class Stage(msgspec.Struct, frozen=True):
    name: str  # decode, resize, crop, encode, facts
    start_ns: int  # time.time_ns() in the render process
    end_ns: int
    rendition: str = ""  # the rendition a resize, crop or encode made


class Stages:
    """One render's stage clock: off (an untraced photo), `timed` is an empty context."""

    def __init__(self, on: bool) -> None:
        self.done: list[Stage] | None = [] if on else None

    @contextlib.contextmanager
    def timed(self, name: str, rendition: str = "") -> Iterator[None]:
        if self.done is None:
            yield
            return
        start_ns = time.time_ns()
        yield  # a stage that raises is not kept: the render's error is the news
        self.done.append(Stage(name, start_ns, time.time_ns(), rendition))


OFF = Stages(False)
