"""What an attempt's end means (elastic.supervisor.policy.decide_end): pure, no Ray."""

from __future__ import annotations

from elastic.supervisor.attempt import EndCause
from elastic.supervisor.policy import EndDecision, decide_end


def end(
    stopped_as: EndCause | None = None,
    error: str | None = None,
    paused_at: int | None = None,
    checkpoint_step: int | None = None,
    shrinking: bool = False,
    lost: frozenset[str] = frozenset(),
    drained: frozenset[str] = frozenset(),
) -> EndDecision:
    return decide_end(stopped_as, error, paused_at, checkpoint_step, shrinking, lost, drained)


def test_a_loop_that_returned_finished_the_job() -> None:
    assert end() == EndDecision(EndCause.FINISHED)


def test_a_clean_end_after_a_pause_is_a_pause_at_that_step() -> None:
    assert end(paused_at=40) == EndDecision(EndCause.PAUSED, paused_at=40)


def test_a_shrunk_in_place_attempt_that_ended_cleanly_paused_at_its_newest_checkpoint() -> None:
    assert end(shrinking=True, checkpoint_step=30) == EndDecision(EndCause.PAUSED, paused_at=30)
    assert end(shrinking=True) == EndDecision(EndCause.PAUSED, paused_at=0)
    # A failure is no pause, whatever the scheduler asked for.
    assert end(shrinking=True, checkpoint_step=30, error="boom") == EndDecision(EndCause.ERROR)


def test_an_error_with_a_node_gone_is_a_node_loss_and_names_it() -> None:
    assert end(error="peer closed", lost=frozenset({"n2"})) == EndDecision(
        EndCause.NODE_LOST, frozenset({"n2"})
    )
    assert end(error="a NaN loss") == EndDecision(EndCause.ERROR)


def test_a_group_that_failed_as_it_left_drained_nodes_after_its_pause_only_paused() -> None:
    assert end(
        error="peer closed", paused_at=50, lost=frozenset({"n2"}), drained=frozenset({"n2", "n3"})
    ) == EndDecision(EndCause.PAUSED, paused_at=50, left_drained=True)
    # A node lost beside the drained one is a loss.
    assert end(
        error="peer closed", paused_at=50, lost=frozenset({"n1", "n2"}), drained=frozenset({"n2"})
    ) == EndDecision(EndCause.NODE_LOST, frozenset({"n1", "n2"}), paused_at=50)
    # Without the pause, losing a node that had a drain notice is still a loss.
    assert end(
        error="peer closed", lost=frozenset({"n2"}), drained=frozenset({"n2"})
    ) == EndDecision(EndCause.NODE_LOST, frozenset({"n2"}))


def test_the_supervisor_s_own_stop_names_the_cause_and_only_a_loss_keeps_its_nodes() -> None:
    assert end(
        stopped_as=EndCause.NODE_LOST, error="stopped", lost=frozenset({"n1"})
    ) == EndDecision(EndCause.NODE_LOST, frozenset({"n1"}))
    assert end(
        stopped_as=EndCause.START_TIMEOUT, error="not placed", lost=frozenset({"n1"})
    ) == EndDecision(EndCause.START_TIMEOUT)
    assert end(stopped_as=EndCause.PAUSED, paused_at=20) == EndDecision(
        EndCause.PAUSED, paused_at=20
    )
