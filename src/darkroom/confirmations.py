"""Which delivery spans an export delivered: the exporter reports each batch it delivered, the
worker marks those attempt rows (latespans.py), and a row no export confirmed gets its span
written late from the history (docs/tracing.md).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# (photo id, span id) of each `darkroom.process` span an export delivered: appended by the
# batch processor's thread, drained by the event loop (latespans.py) into the attempt rows.
# A deque's append and popleft are atomic; bounded, should the database be away for long.
_confirmed: collections.deque[tuple[str, str]] = collections.deque(maxlen=100_000)
# Called by the export thread after each confirmed batch (latespans.py wakes its loop with
# it): the sooner the rows learn it, the narrower a kill's window to make a late copy.
_on_confirmed: list[Callable[[], object]] = []


def confirming(exporter: Any) -> Any:
    """The exporter, reporting each `darkroom.process` span of a batch it delivered."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Confirming(SpanExporter):
        def export(self, spans: Any) -> Any:
            result = exporter.export(spans)
            if result is SpanExportResult.SUCCESS:
                _confirmed.extend(_process_ids(spans))
                for wake in _on_confirmed:
                    wake()
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    return Confirming()


def _process_ids(spans: Iterable[Any]) -> Iterator[tuple[str, str]]:
    for done in spans:
        photo = (done.attributes or {}).get("darkroom.photo_id")
        if done.name == "darkroom.process" and photo:
            yield str(photo), format(done.context.span_id, "016x")


def confirmed() -> list[tuple[str, str]]:
    """The (photo id, span id) of the delivery spans exported since the last call."""
    out = []
    with contextlib.suppress(IndexError):  # emptied meanwhile
        while _confirmed:
            out.append(_confirmed.popleft())
    return out


def when_confirmed(wake: Callable[[], object] | None) -> None:
    """Have `wake` called (from the export thread) after each export that confirmed spans;
    None: no more."""
    _on_confirmed[:] = [wake] if wake is not None else []


def unconfirmed(pairs: Iterable[tuple[str, str]]) -> None:
    """Give back what `confirmed` returned and could not be recorded (the database was away)."""
    _confirmed.extendleft(pairs)
