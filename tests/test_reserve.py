"""The feeder's reserve (queue/reserve.py): pure, with made-up times."""

from __future__ import annotations

import itertools

from darkroom.queue.reserve import Reserve


def test_the_places_are_the_floor_while_nothing_is_taken() -> None:
    reserve = Reserve()
    assert reserve.size(8) == 8, "no look yet"
    reserve.look(0.0, 8)
    reserve.look(1.0, 8)
    assert reserve.size(8) == 8


def test_quick_takes_grow_the_reserve_to_a_quarter_second_of_them() -> None:
    """Workers take 200 entries a second (the feeder tops up what they took): the reserve
    grows, doubling at most per look, to what they take in 0.25 s, 50, past their 8
    places; so a top-up by halves feeds 25 at a time, not 4."""
    reserve, sizes = Reserve(), []
    for tick in range(31):
        reserve.look(tick * 0.1, 0)  # 20 taken since the last look: nothing left
        reserve.fed(20)
        sizes.append(reserve.size(8))
    assert reserve.rate() == 200.0
    assert sizes[-1] == 50 and all(b <= max(8, 2 * a) for a, b in itertools.pairwise(sizes))


def test_what_is_left_undelivered_was_not_taken() -> None:
    reserve = Reserve()
    reserve.look(0.0, 10)
    reserve.fed(30)
    reserve.look(2.0, 25)  # 10 + 30 - 25 = 15 taken in the two seconds
    assert reserve.rate() == 7.5


def test_a_few_takes_milliseconds_apart_are_not_a_rate() -> None:
    """A busy spell's first looks come milliseconds apart (the workers' word wakes the
    feeder at once): 8 taken in 20 ms is not 400 a second."""
    reserve = Reserve()
    reserve.look(100.0, 0)
    reserve.fed(8)
    reserve.look(100.02, 0)
    assert reserve.size(8) == 8


def test_the_reserve_has_a_ceiling_and_forgets_a_burst() -> None:
    """10,000 entries gone in a second (taken, or wiped with Redis): the reserve doubles
    look by look up to `most`, and falls back to the places once the burst left the
    window."""
    reserve = Reserve(most=100)
    reserve.look(0.0, 0)
    reserve.fed(10_000)
    reserve.look(1.0, 0)
    assert [reserve.size(8) for _ in range(6)] == [8, 16, 32, 64, 100, 100]
    for tick in range(2, 6):
        reserve.look(float(tick), 0)  # nothing more fed, nothing taken
    assert reserve.rate() == 0.0 and reserve.size(8) == 8
