"""Two schedules of the interleaving test (tests/test_interleavings.py) played by hand: the
one path where a later claiming row does not mean the job moved on (a restarted worker of
the same name re-claims its own pending entry), which random schedules almost never reach.
A late pass (tests/interleave_spans.py) must not take the live holder's row while its lease
lives, and must take it once the lease has run out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from tests import interleave_spans
from tests import test_interleavings as interleavings
from tests.interleave import Rig, install
from tests.test_interleavings import Interleavings


@pytest.fixture
def machine(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Interleavings]:
    install(monkeypatch)
    for module in (interleavings, interleave_spans):  # Hypothesis' notes need a running test
        monkeypatch.setattr(module, "note", lambda *_: None)
    with asyncio.Runner() as runner:
        rig = Rig(runner, database_url)
        played = type("Played", (Interleavings,), {"rig": rig})()
        try:
            yield played
        finally:
            played.midway = True  # teardown only cleans up
            played.teardown()
            rig.close()


def reclaimed_by_its_own_restarted_worker(machine: Interleavings) -> None:
    machine.photos_first([("interactive", "")])
    machine.take(0, "new", 1)
    machine.kill(0)
    machine.take(0, "own", 1)


@pytest.mark.parametrize("then", [lambda m: None, lambda m: (m.freeze(0), m.time_passes())],
                         ids=["lease live", "lease run out"])  # fmt: skip
def test_a_late_pass_judges_a_reclaimed_own_entry_by_its_live_lease(
    machine: Interleavings, then: Callable[[Interleavings], object]
) -> None:
    """Lease live: the holder's `running` row is not taken (its delivery will export its own
    span). Lease run out: it is due, and taken. The rule's own assertions decide both."""
    reclaimed_by_its_own_restarted_worker(machine)
    then(machine)
    machine.late_pass()
