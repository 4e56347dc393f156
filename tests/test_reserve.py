"""The feeder's reserve (queue/reserve.py): pure, with made-up times."""

from __future__ import annotations

from darkroom.queue.reserve import Reserve


def test_the_places_are_the_floor_while_nothing_is_taken() -> None:
    reserve = Reserve()
    assert reserve.size(8) == 8, "no look yet"
    reserve.look(0.0, 8)
    reserve.look(1.0, 8)
    assert reserve.size(8) == 8


def test_quick_takes_grow_the_reserve_to_a_quarter_second_of_them() -> None:
    """Workers take 200 entries a second (the feeder tops up what they took): the reserve
    holds what they take in 0.25 s, 50, past their 8 places; so a top-up by halves feeds
    25 at a time, not 4."""
    reserve = Reserve()
    for tick in range(11):
        reserve.look(tick * 0.1, 0)  # 20 taken since the last look: nothing left
        reserve.fed(20)
    assert reserve.rate() == 200.0
    assert reserve.size(8) == 50


def test_what_is_left_undelivered_was_not_taken() -> None:
    reserve = Reserve()
    reserve.look(0.0, 10)
    reserve.fed(30)
    reserve.look(1.0, 25)  # 10 + 30 - 25 = 15 taken in the second
    assert reserve.rate() == 15.0


def test_the_rate_is_the_last_two_seconds_and_the_reserve_has_a_ceiling() -> None:
    reserve = Reserve(most=100)
    reserve.look(0.0, 0)
    reserve.fed(10_000)
    reserve.look(1.0, 0)
    assert reserve.size(8) == 100, "at most `most`"
    for tick in range(2, 6):
        reserve.look(float(tick), 0)  # nothing more fed, nothing taken
    assert reserve.rate() == 0.0 and reserve.size(8) == 8, "the burst left the window"
