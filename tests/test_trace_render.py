"""The render process's own stages in the photo's trace: it times its decode, resizes and
encodes (it runs no tracing itself) and the worker makes them children of its render span;
an untraced render times nothing."""

from __future__ import annotations

from darkroom.image.pipeline import render
from darkroom.settings import Settings
from tests.conftest import Env
from tests.test_tracing import (
    PHOTO,
    Receiver,
    add_photo,
    otel,
    process_spans,
    producer_span,
    receiver,
    xadd,
)

__all__ = ["receiver"]  # the fixture, used by name


def test_the_render_process_stages_are_children_of_the_render_span(
    file_env: Env, receiver: Receiver
) -> None:
    """A traced photo's render span has a decode child and an encode child per rendition,
    each inside the render span's time, all in the producer's trace."""
    trace_id, _, carrier = producer_span()
    xadd(file_env, add_photo(file_env), carrier)
    file_env.cli("run", "--drain", **otel(receiver))
    [process] = process_spans(receiver, trace_id)
    [rendering] = [s for s in receiver.of_trace(trace_id)
                   if s.name == "darkroom.render" and s.parent_id == process.span_id]  # fmt: skip
    children = [s for s in receiver.of_trace(trace_id) if s.parent_id == rendering.span_id]
    names = [s.name for s in children]
    assert names.count("darkroom.decode") == 1 and "darkroom.facts" in names
    encoded = {s.attributes["darkroom.rendition"] for s in children if s.name == "darkroom.encode"}
    assert encoded == {spec.name for spec in Settings().renditions}
    assert all(rendering.start_ns <= s.start_ns <= s.end_ns <= rendering.end_ns for s in children)


def test_an_untraced_render_times_no_stage() -> None:
    """Not asked to time its stages, the pipeline records none: nothing to send back or export."""
    result = render(PHOTO.read_bytes(), Settings().renditions, Settings().max_pixels)
    assert result.renditions and result.stages == []
