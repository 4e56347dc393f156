"""The pure pieces of pause and resume: which scopes a set of pauses holds (what a worker
reads and what its feeder feeds), the fair scheduler's parking of a paused tenant, and the
`--for` durations the command line takes."""

from __future__ import annotations

import argparse
import uuid

import pytest

from darkroom.operate.pause import parse_for
from darkroom.queue.pauses import Paused
from darkroom.queue.scheduler import Pending, Refill, Scheduler


def paused(*scopes: tuple[str | None, str | None]) -> Paused:
    return Paused.of({"lane": lane, "tenant": tenant} for lane, tenant in scopes)


def test_a_lane_is_paused_only_by_a_pause_of_every_tenant() -> None:
    """A lane's stream stops being read for a pause of it or of everything, never for a
    pause of one tenant; a tenant's pause holds it in every lane or in its own."""
    assert paused((None, None)).lane("bulk") and paused(("bulk", None)).lane("bulk")
    assert not paused(("bulk", None)).lane("interactive")
    assert not paused((None, "acme")).lane("bulk")
    both = paused((None, "acme"), ("bulk", "zed"))
    assert both.tenants("bulk") == {"acme", "zed"} and both.tenants("interactive") == {"acme"}
    assert both.covers("interactive", "acme") and not both.covers("interactive", "zed")
    assert paused(("bulk", "")).covers("bulk", "") and not paused(("bulk", "")).covers("bulk", "x")
    assert not Paused().lane("bulk") and not Paused().covers("bulk", "acme")


def drain(scheduler: Scheduler, backlog: dict[str, int]) -> list[str]:
    """Tenants in the order the scheduler starts their photos, loading as it asks."""
    started = []
    while (choice := scheduler.next()) is not None:
        if isinstance(choice, Refill):
            left = backlog.get(choice.tenant, 0)
            backlog[choice.tenant] = 0
            scheduler.refill(choice.tenant, [Pending(uuid.uuid4(), choice.tenant)] * left)
        else:
            started.append(choice.tenant)
    return started


def test_a_held_tenant_starts_nothing_and_rejoins_the_ring_once_let_go() -> None:
    """The feeder's scheduler passes over a paused tenant while the others run, and starts
    its photos once the pause ends; none is lost meanwhile."""
    scheduler = Scheduler()
    for tenant in ("acme", "zed"):
        scheduler.add(tenant)
    backlog = {"acme": 3, "zed": 3}
    scheduler.hold(frozenset({"acme"}))
    assert drain(scheduler, backlog) == ["zed"] * 3
    scheduler.hold(frozenset())
    assert drain(scheduler, backlog) == ["acme"] * 3


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("15m", 900), ("2h", 7200),
                                               ("1.5h", 5400)])  # fmt: skip
def test_durations_take_seconds_minutes_or_hours(text: str, seconds: float) -> None:
    """`--for` reads 90s, 15m, 2h (and fractions) as seconds."""
    assert parse_for(text) == seconds


@pytest.mark.parametrize("text", ["", "2", "3x", "0s", "-1m", "1d", "h"])
def test_a_duration_without_a_unit_or_above_zero_is_refused(text: str) -> None:
    """Anything but a positive number and s, m or h is a usage error."""
    with pytest.raises(argparse.ArgumentTypeError):
        parse_for(text)
