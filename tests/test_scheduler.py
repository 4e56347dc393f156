"""The bulk scheduler, a pure function of its inputs: shares by cost, weights, the in-flight
cap, newcomers and the cost of a pick with many tenants."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter, deque

from darkroom.queue.scheduler import (
    DEFAULT_COST,
    PHOTO_CHARGE,
    QUANTUM,
    Pending,
    Refill,
    Scheduler,
)

PAGE = 4


def backlog(tenant: str, count: int, cost: int | None) -> deque[Pending]:
    return deque(Pending(uuid.uuid4(), tenant, cost) for _ in range(count))


def pick(sched: Scheduler, waiting: dict[str, deque[Pending]]) -> Pending | None:
    """One pick, answering the scheduler's refills from `waiting` a page at a time."""
    while isinstance(chosen := sched.next(), Refill):
        queue = waiting[chosen.tenant]
        sched.refill(chosen.tenant, [queue.popleft() for _ in range(min(PAGE, len(queue)))])
    return chosen


def run(sched: Scheduler, waiting: dict[str, deque[Pending]], picks: int) -> list[Pending]:
    for tenant in waiting:
        sched.add(tenant)
    return [p for _ in range(picks) if (p := pick(sched, waiting)) is not None]


def cost_by_tenant(picked: list[Pending]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for photo in picked:
        totals[photo.tenant] += photo.charge
    return totals


def test_equal_weights_share_cost_not_count() -> None:
    """A tenant of 4x larger photos gets a quarter of the photos and the same pixels."""
    waiting = {"big": backlog("big", 500, 8_000_000), "small": backlog("small", 2000, 2_000_000)}
    totals = cost_by_tenant(run(Scheduler(), waiting, 500))
    assert abs(totals["big"] - totals["small"]) <= 8_000_000


def test_a_tenant_with_a_huge_backlog_gets_no_more_than_its_share() -> None:
    """Backlog size buys nothing: three tenants, one with 100x the photos, share evenly."""
    waiting = {
        "heavy": backlog("heavy", 10_000, 3_000_000),
        "a": backlog("a", 100, 20_000_000),
        "b": backlog("b", 100, 8_000_000),
    }
    totals = cost_by_tenant(run(Scheduler(), waiting, 150))
    mean = sum(totals.values()) / 3
    assert all(abs(t - mean) <= 0.1 * mean for t in totals.values()), totals


def test_weights_scale_the_share() -> None:
    """acme=2 gets twice beta's pixels."""
    waiting = {"acme": backlog("acme", 1000, 5_000_000), "beta": backlog("beta", 1000, 5_000_000)}
    totals = cost_by_tenant(run(Scheduler({"acme": 2}), waiting, 600))
    assert abs(totals["acme"] / totals["beta"] - 2) < 0.05


def test_unknown_cost_is_charged_the_default() -> None:
    """A photo without a cost counts as DEFAULT_COST: as much as five of 2 MP, each photo
    charged PHOTO_CHARGE on top."""
    waiting = {"unknown": backlog("unknown", 10, None), "known": backlog("known", 60, 2_000_000)}
    picked = run(Scheduler(), waiting, 24)
    assert Counter(p.tenant for p in picked) == {"unknown": 4, "known": 20}
    assert picked[0].charge == DEFAULT_COST + PHOTO_CHARGE


def test_tenants_of_tiny_photos_take_turns_within_a_few_photos() -> None:
    """Avatars (64×48) of two tenants alternate in short turns: neither waits behind
    hundreds of the other's, as it would if only pixels were charged."""
    waiting = {"a": backlog("a", 1000, 64 * 48), "b": backlog("b", 1000, 64 * 48)}
    picked = [p.tenant for p in run(Scheduler(), waiting, 40)]
    longest = max(len(list(turn)) for _, turn in itertools.groupby(picked))
    assert longest <= 4 and min(Counter(picked).values()) >= 16


def test_the_in_flight_cap_parks_a_tenant_until_settled() -> None:
    """At its cap a tenant gets nothing more until its photos finish; others go on."""
    sched = Scheduler(max_in_flight=2)
    waiting = {"a": backlog("a", 10, QUANTUM // 10), "b": backlog("b", 10, QUANTUM // 10)}
    picked = run(sched, waiting, 10)
    assert Counter(p.tenant for p in picked) == {"a": 2, "b": 2}
    sched.settle({"a": 1, "b": 2})
    assert [p.tenant for p in run(sched, waiting, 10)] == ["a"]


def test_a_newcomer_starts_within_one_round() -> None:
    """A tenant that arrives is served before any tenant already waiting gets a second turn."""
    sched = Scheduler()
    waiting = {f"t{i}": backlog(f"t{i}", 5, QUANTUM) for i in range(100)}
    run(sched, waiting, 40)
    waiting["new"] = backlog("new", 5, QUANTUM)
    after = [p.tenant for p in run(sched, waiting, 101)]
    assert "new" in after
    before_new = after[: after.index("new")]
    assert len(before_new) == len(set(before_new)) <= 100


def test_a_drained_tenant_leaves_and_nothing_is_left() -> None:
    """Every photo is picked exactly once, then the scheduler has nothing and no tenant."""
    sched = Scheduler()
    waiting = {"a": backlog("a", 7, None), "b": backlog("b", 3, 1)}
    ids = {p.photo_id for q in waiting.values() for p in q}
    picked = run(sched, waiting, 20)
    assert sorted(p.photo_id for p in picked) == sorted(ids)
    assert sched.next() is None and len(sched) == 0


def test_a_pick_stays_cheap_with_10000_backlogged_tenants() -> None:
    """10,000 tenants in the ring: a pick costs microseconds, not a scan."""
    sched = Scheduler()
    waiting = {f"t{i}": backlog(f"t{i}", 3, 5_000_000 + i) for i in range(10_000)}
    run(sched, waiting, 1)
    started = time.perf_counter()
    picked = run(sched, waiting, 5_000)
    per_pick_s = (time.perf_counter() - started) / len(picked)
    assert len(picked) == 5_000 and per_pick_s < 1e-4
