"""Judging the traces a chaos run exported, photo by photo, against PostgreSQL's attempt
history: one trace from the producer's span, every span's parent chain reaching it, the
final publish in it, and every attempt in it. Pure: spans and rows in, a verdict out.

What a SIGKILL does to a trace: a span is exported once it ends, so the delivery a kill cuts
short never exports its `darkroom.process` span itself (no in-process SDK can), while the
stages it finished before the kill (the claim, the download...) may have been exported
already. The delivery that reclaims its job writes that span for it (`worker_died`, the span
id its claim kept on the attempt row), unless that delivery is killed in turn before its
export: a killed attempt counts as in the trace when a span of its row's id is. And a
delivery that ended just before the kill may still sit in its batch span processor's queue
(OTEL_BSP_SCHEDULE_DELAY). Each is counted apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.otlp import Span

PROCESS, PUBLISH = "darkroom.process", "darkroom.publish"


@dataclass
class Verdict:
    """One photo's trace, judged."""

    one_trace: bool = False  # its spans are all in its producer's trace, and that span is there
    connected: bool = False  # every span's parent chain reaches the producer's span
    published: bool = False  # a publish span under a delivery whose outcome is `published`
    ended_attempts_in: bool = False  # every attempt that ended has its delivery's span
    killed_attempts: int = 0  # attempts a SIGKILL cut short (`running` for good)
    killed_written: int = 0  # of those, whose span the reclaiming delivery wrote (exported)
    dangling: int = 0  # spans whose parent is missing (a killed delivery's finished stages)
    lost_ended: int = 0  # attempts that ended whose span is missing
    missing_parents: int = 0  # distinct parents named in the trace but never exported
    # the ended attempts whose span may be the one missing: (consumer, ended_at) of each row
    # of an entry with fewer delivery spans than ended attempts
    lost: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        """The target's reading: one connected trace to the publish, every attempt in it (a
        killed one by the span its reclaimer wrote)."""
        return (self.one_trace and self.connected and self.published
                and self.ended_attempts_in
                and self.killed_written == self.killed_attempts)  # fmt: skip

    @property
    def whole_but_kills(self) -> bool:
        """The same, forgiving the killed deliveries' spans no reclaim wrote (its reclaimer
        was killed in turn before its export), so the stages they had finished hang from a
        missing parent."""
        unwritten = self.killed_attempts - self.killed_written
        forgiven = self.connected or (0 < self.missing_parents <= unwritten)
        return self.one_trace and self.published and self.ended_attempts_in and forgiven


@dataclass
class Judged:
    verdicts: dict[str, Verdict] = field(default_factory=dict)

    def share(self, attr: str) -> float:
        return sum(getattr(v, attr) for v in self.verdicts.values()) / max(1, len(self.verdicts))

    def figures(self) -> dict[str, Any]:
        v = self.verdicts.values()
        return {
            "photos": len(self.verdicts),
            "whole_traces": sum(x.whole for x in v),
            "whole_traces_pct": round(100 * self.share("whole"), 2),
            "whole_but_kills": sum(x.whole_but_kills for x in v),
            "whole_but_kills_pct": round(100 * self.share("whole_but_kills"), 2),
            "one_trace": sum(x.one_trace for x in v),
            "connected": sum(x.connected for x in v),
            "published_in_trace": sum(x.published for x in v),
            "every_ended_attempt_in": sum(x.ended_attempts_in for x in v),
            "photos_with_a_killed_attempt": sum(bool(x.killed_attempts) for x in v),
            "killed_attempts": sum(x.killed_attempts for x in v),
            "killed_attempts_written": sum(x.killed_written for x in v),
            "dangling_spans": sum(x.dangling for x in v),
            "ended_attempts_lost": sum(x.lost_ended for x in v),
        }


def judge(spans: list[Span], attempts: Iterable[dict[str, Any]], photos: Iterable[str]) -> Judged:
    """`attempts`: photo_attempts rows (photo_id, entry_id, consumer, ended_at, span_id) after
    the run settled (a `running` one was cut short by a kill); `photos`: the ids to judge."""
    by_id = {s.span_id: s for s in spans}
    by_trace: dict[str, list[Span]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in attempts:
        rows.setdefault(str(row["photo_id"]), []).append(row)
    of_photo: dict[str, list[Span]] = {}
    for s in spans:
        if (photo := s.attributes.get("darkroom.photo_id")) is not None:
            of_photo.setdefault(str(photo), []).append(s)
    judged = Judged()
    for photo in photos:
        judged.verdicts[photo] = _verdict(of_photo.get(photo, []), rows.get(photo, []),
                                          by_id, by_trace)  # fmt: skip
    return judged


def _verdict(
    mine: list[Span], rows: list[dict[str, Any]], by_id: dict[str, Span],
    by_trace: dict[str, list[Span]],
) -> Verdict:  # fmt: skip
    verdict = Verdict(killed_attempts=sum(r["ended_at"] is None for r in rows))
    producers = [s for s in mine if s.name == "darkroom.ingest"]
    if len(producers) != 1:
        return verdict
    root = producers[0]
    trace = by_trace[root.trace_id]
    verdict.one_trace = {s.trace_id for s in mine} == {root.trace_id}
    tops = [_top(s, root, by_id) for s in trace]
    missing = {top for top in tops if top is not None}
    verdict.dangling = sum(s is not root and s.parent_id not in by_id for s in trace)
    verdict.missing_parents = len(missing)
    verdict.connected = not missing
    processes = [s for s in trace if s.name == PROCESS]
    published = {
        s.span_id for s in processes if s.attributes.get("darkroom.outcome") == "published"
    }
    verdict.published = any(s.name == PUBLISH and s.parent_id in published for s in trace)
    _attempts_in(verdict, rows, processes)
    return verdict


def _attempts_in(verdict: Verdict, rows: list[dict[str, Any]], processes: list[Span]) -> None:
    """Which attempts have their delivery's span: a row with a span id (its claim traced) by
    that id; a row without one (a delivery that claimed nothing writes its row whole) by its
    entry, among the spans no row names."""
    ids = {s.span_id for s in processes}
    killed = [r for r in rows if r["ended_at"] is None]
    verdict.killed_written = sum(r["span_id"] in ids for r in killed)
    ended = [r for r in rows if r["ended_at"] is not None]
    named = {r["span_id"] for r in rows if r["span_id"]}
    lost = [r for r in ended if r["span_id"] and r["span_id"] not in ids]
    unnamed = Counter(r["entry_id"] for r in ended if not r["span_id"])
    spanned = Counter(s.attributes.get("messaging.message.id") for s in processes
                      if s.span_id not in named)  # fmt: skip
    short = unnamed - spanned
    verdict.lost_ended = len(lost) + sum(short.values())
    lost += [r for r in ended if not r["span_id"] and r["entry_id"] in short]
    verdict.lost = [(r["consumer"], r["ended_at"]) for r in lost]
    verdict.ended_attempts_in = not verdict.lost_ended


def _top(span: Span, root: Span, by_id: dict[str, Span]) -> str | None:
    """None when `span`'s parent chain ends at `root`; else the parent id it breaks at."""
    seen: set[str] = set()
    while span is not root:
        if span.span_id in seen or span.parent_id not in by_id:
            return span.parent_id
        seen.add(span.span_id)
        span = by_id[span.parent_id]
    return None
