from itertools import product

import pytest

from elastic.job_state import (
    TRANSITIONS,
    IllegalTransition,
    JobState,
    can_transition,
    check_transition,
)

LEGAL = {
    ("queued", "starting"),
    ("queued", "failed"),
    ("queued", "cancelled"),
    ("starting", "queued"),
    ("starting", "running"),
    ("starting", "recovering"),
    ("starting", "failed"),
    ("starting", "cancelled"),
    ("running", "recovering"),
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "cancelled"),
    ("running", "queued"),  # preempted by the scheduler for a job of higher priority
    ("recovering", "running"),
    ("recovering", "queued"),  # held back by the scheduler while it recovers
    ("recovering", "failed"),
    ("recovering", "cancelled"),
}


def test_the_table_is_exactly_the_documented_machine() -> None:
    table = {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == LEGAL


@pytest.mark.parametrize("current,target", list(product(JobState, JobState)))
def test_every_pair_is_allowed_or_refused(current: JobState, target: JobState) -> None:
    if (current.value, target.value) in LEGAL:
        assert can_transition(current, target)
        assert check_transition(current, target) is target
    else:
        assert not can_transition(current, target)
        with pytest.raises(IllegalTransition) as err:
            check_transition(current, target)
        assert str(err.value) == f"a job cannot go from {current.value} to {target.value}"


def test_terminal_states_end_everything() -> None:
    assert {s for s in JobState if s.is_terminal} == {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    }
    for s in JobState:
        if s.is_terminal:
            assert TRANSITIONS[s] == frozenset()
