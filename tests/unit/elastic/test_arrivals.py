"""A sender's numbered calls, put back in the order it sent them (elastic.arrivals)."""

from __future__ import annotations

from elastic.arrivals import InOrder
from tests.clock import Clock


def test_a_call_ahead_of_a_gap_waits_for_it_and_both_go_on_in_order() -> None:
    order: InOrder[str] = InOrder(hold_s=1.0, clock=Clock())
    assert order.accept("w", 0, "step 1") == ["step 1"]
    assert order.accept("w", 2, "step 3") == []
    assert order.accept("w", 3, "step 4") == []
    assert order.held() == 2
    assert order.accept("w", 1, "step 2") == ["step 2", "step 3", "step 4"]
    assert order.held() == 0


def test_senders_are_ordered_apart() -> None:
    order: InOrder[str] = InOrder(clock=Clock())
    assert order.accept("a", 1, "a1") == []
    assert order.accept("b", 0, "b0") == ["b0"]
    assert order.accept("a", 0, "a0") == ["a0", "a1"]


def test_a_gap_that_does_not_fill_in_time_is_given_up_and_nothing_is_dropped() -> None:
    clock = Clock()
    order: InOrder[str] = InOrder(hold_s=1.0, clock=clock)
    assert order.accept("w", 1, "s1") == []  # the first call itself may come second
    order.accept("w", 2, "s2")
    assert order.accept("w", 4, "s4") == []  # two gaps: 0 is missing, and 3
    clock.now = 0.9
    assert order.overdue() == []
    clock.now = 1.0
    assert order.overdue() == ["s1", "s2", "s4"]
    assert order.held() == 0
    # The missing ones come after all: they go on when they come, and the order goes on.
    assert order.accept("w", 3, "s3") == ["s3"]
    assert order.accept("w", 0, "s0") == ["s0"]
    assert order.accept("w", 6, "s6") == []
    assert order.accept("w", 5, "s5") == ["s5", "s6"]


def test_release_all_hands_over_every_sender_in_order() -> None:
    clock = Clock()
    order: InOrder[str] = InOrder(hold_s=60.0, clock=clock)
    order.accept("a", 2, "a2")
    order.accept("a", 1, "a1")
    order.accept("b", 5, "b5")
    assert order.release_all() == ["a1", "a2", "b5"]
    assert order.release_all() == []
    # A forgotten sender's late call is held like a new sender's out-of-order one, then
    # goes on: late, never lost.
    assert order.accept("b", 6, "b6") == []
    assert order.overdue() == []
    clock.now = 60.0
    assert order.overdue() == ["b6"]


def test_a_call_sent_again_is_dropped_and_a_late_one_past_a_gap_goes_on_once() -> None:
    """A sender that could not tell whether its call arrived (the supervisor was unavailable
    a moment) sends it again: the repeat of a number that went on is dropped, while a call
    that comes late past a gap given up on still goes on, once."""
    clock = Clock()
    order: InOrder[str] = InOrder(hold_s=1.0, clock=clock)
    assert order.accept("w", 0, "s0") == ["s0"]
    assert order.accept("w", 0, "s0 again") == []
    assert order.accept("w", 4, "s4") == []  # 1, 2 and 3 are missing
    clock.now = 1.0
    assert order.overdue() == ["s4"]
    assert order.accept("w", 2, "s2") == ["s2"]
    assert order.accept("w", 2, "s2 again") == []
    assert order.accept("w", 4, "s4 again") == []
    assert order.accept("w", 3, "s3") == ["s3"]
    assert order.accept("w", 1, "s1") == ["s1"]
    assert order.accept("w", 1, "s1 again") == []
    assert order.accept("w", 5, "s5") == ["s5"]
