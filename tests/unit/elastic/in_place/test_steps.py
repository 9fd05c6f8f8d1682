"""The arithmetic of an in-place step: shares of the global batch over a quorum, the loss
weight that makes the all-reduced sum the exact mean, and what a quorum change cost."""

from dataclasses import fields

import numpy as np
import pytest

from elastic.events import Joined, WorkerLost, WorldChange
from elastic.in_place.steps import (
    Timeline,
    loss_weight,
    participant_indices,
    quorum_events,
    step_positions,
)
from elastic.train.sampling import SamplerPosition, epoch_permutation


@pytest.mark.parametrize("participants", [1, 2, 3])
def test_the_participants_split_exactly_the_steps_positions(participants: int) -> None:
    perm = epoch_permutation(1000, seed=7, epoch=0)
    position = SamplerPosition(0, 63 * 4)  # step 5 of the epoch
    parts = [
        participant_indices(perm, position, 1000, 63, participants, r) for r in range(participants)
    ]
    assert all(batch == 63 for _, batch in parts)
    together = [i for indices, _ in parts for i in indices]
    assert together == [int(i) for i in perm[252:315]]
    sizes = [len(indices) for indices, _ in parts]
    assert max(sizes) - min(sizes) <= 1


def test_the_last_step_of_an_epoch_is_short_and_still_split_whole() -> None:
    perm = epoch_permutation(1000, seed=7, epoch=2)
    position = SamplerPosition(2, 945)
    assert step_positions(position, 1000, 63) == range(945, 1000)
    parts = [participant_indices(perm, position, 1000, 63, 2, r) for r in range(2)]
    assert [batch for _, batch in parts] == [55, 55]
    assert [len(i) for i, _ in parts] == [28, 27]
    assert parts[0][0] + parts[1][0] == [int(i) for i in perm[945:]]


def test_weighted_sums_over_any_split_are_the_global_mean() -> None:
    losses = np.random.default_rng(0).random(63)
    for participants in (1, 2, 3):
        total = 0.0
        for r in range(participants):
            base, extra = divmod(63, participants)
            start = r * base + min(r, extra)
            end = start + base + (1 if r < extra else 0)
            total += losses[start:end].sum() * loss_weight(63)
        assert total == pytest.approx(losses.mean(), rel=1e-12)


def test_a_loss_redone_once_is_timed_from_the_first_failure() -> None:
    t = Timeline()
    assert t.committed(1, 3, now=10.0) is None
    assert t.committed(2, 3, now=10.2) is None
    t.failed(now=10.3)  # the collective of step 3 lost a peer
    t.failed(now=10.5)  # the first retry did not form a quorum in time either
    change = t.committed(3, 2, now=10.9)
    assert change is not None
    assert (change.kind, change.from_world, change.to_world, change.step) == (
        "worker_lost",
        3,
        2,
        3,
    )
    assert change.steps_redone == 1  # one step, redone whole, however many tries
    assert change.pause_seconds == pytest.approx(0.7)
    assert change.recovery_seconds == pytest.approx(0.6)
    assert t.longest_pause == pytest.approx(0.7)


def test_a_join_redoes_nothing_and_the_next_steps_are_quiet() -> None:
    t = Timeline()
    t.committed(7, 2, now=1.0)
    change = t.committed(8, 3, now=1.4)
    assert change is not None
    assert (change.kind, change.steps_redone, change.recovery_seconds) == ("joined", 0, None)
    assert change.pause_seconds == pytest.approx(0.4)
    assert t.committed(9, 3, now=1.5) is None


def test_a_lost_replica_replaced_in_the_same_quorum_change_is_a_loss_and_a_join() -> None:
    t = Timeline()
    t.committed(20, 2, now=5.0, members=frozenset({1, 2}))
    assert t.committed(21, 2, now=5.1, members=frozenset({1, 2})) is None
    t.failed(now=5.3)  # replica 1 was lost while it sent its state to replica 3
    change = t.committed(22, 2, now=5.9, members=frozenset({2, 3}))
    assert change is not None
    assert (change.kind, change.from_world, change.to_world) == ("worker_lost", 2, 2)
    assert (change.left, change.joined, change.steps_redone) == ([1], [3], 1)
    assert change.as_event(WorkerLost).replicas == (1,)
    assert change.pause_seconds == pytest.approx(0.8)


def test_members_name_who_left_and_who_joined() -> None:
    t = Timeline()
    t.committed(1, 3, now=0.0, members=frozenset({0, 1, 2}))
    lost = t.committed(2, 2, now=1.0, members=frozenset({0, 2}))
    assert lost is not None and (lost.kind, lost.left, lost.joined) == ("worker_lost", [1], [])
    back = t.committed(3, 3, now=2.0, members=frozenset({0, 2, 3}))
    assert back is not None and (back.kind, back.left, back.joined) == ("joined", [], [3])
    assert back.as_event(Joined).replicas == (3,)
    # Without members (not known), only the size tells.
    assert t.committed(4, 3, now=2.1) is None
    shrunk = t.committed(5, 2, now=2.2)
    assert shrunk is not None and shrunk.kind == "worker_lost" and shrunk.left == []
    assert shrunk.as_event(WorkerLost).replicas == ()


Told = tuple[str, str, object, object]  # (event kind, its data's kind, replicas, reason)


def kinds_and_replicas(
    t: Timeline, *commit: tuple[int, int, float, frozenset[int]]
) -> list[list[Told]]:
    """The events each quorum change of ``commit`` (step, world, time, members) is told as."""
    out = []
    for step, world, now, members in commit:
        change = t.committed(step, world, now, members)
        if change is not None:
            out.append(
                [
                    (k, d["kind"], d.get("replicas"), d.get("reason"))
                    for k, d in quorum_events(change)
                ]
            )
    return out


def test_a_quorum_change_is_told_as_the_job_s_events_a_loss_a_join_and_a_resize() -> None:
    t = Timeline()
    events = kinds_and_replicas(
        t,
        (1, 3, 0.0, frozenset({0, 1, 2})),
        (2, 2, 1.0, frozenset({0, 2})),  # replica 1 lost: a loss and a resize
        (3, 3, 2.0, frozenset({0, 2, 3})),  # replica 3 joined: a join and a resize
    )
    assert events == [
        [("worker_lost", "worker_lost", [1], None), ("resized", "resized", [1], None)],
        [("joined", "joined", [3], None), ("resized", "resized", [3], None)],
    ]


def test_a_lost_replica_replaced_at_once_is_a_loss_and_a_join_with_no_resize() -> None:
    t = Timeline()
    events = kinds_and_replicas(t, (20, 2, 5.0, frozenset({1, 2})), (22, 2, 5.9, frozenset({2, 3})))
    assert events == [[("worker_lost", "worker_lost", [1], None), ("joined", "joined", [3], None)]]


def test_a_drain_is_only_a_resize_that_says_so() -> None:
    t = Timeline()
    t.committed(1, 3, 0.0, frozenset({0, 1, 2}))
    t.expect_drain()
    change = t.committed(2, 2, 1.0, frozenset({0, 1}))
    assert change is not None
    ((kind, data),) = quorum_events(change)
    assert (kind, data["reason"], data["replicas"], data["from_world"], data["to_world"]) == (
        "resized",
        "drain",
        [2],
        3,
        2,
    )
    assert data["in_place"] is True and data["steps_redone"] == 0


def test_a_loss_in_place_carries_the_same_fields_as_one_in_restart_mode() -> None:
    """One payload class per kind, shared by both modes: a reader never asks which mode wrote
    an event; what a mode cannot know is None or empty."""
    t = Timeline()
    t.committed(1, 3, 0.0, frozenset({0, 1, 2}))
    t.failed(now=0.9)
    change = t.committed(2, 2, 1.25, frozenset({0, 2}))
    assert change is not None
    (lost, _), (resized, _) = [(d, k) for k, d in quorum_events(change)]
    restart = WorkerLost(from_world=3, ranks=(1,), nodes=("n1",), reason="node n1 left")
    assert set(lost) == set(restart.data()) == {"kind", *(f.name for f in fields(WorldChange))}
    assert lost == {
        "kind": "worker_lost",
        "from_world": 3,
        "to_world": 2,
        "steps_redone": 1,
        "recovery_seconds": 0.35,
        "detection_seconds": None,
        "pause_seconds": 1.25,
        "checkpoint_step": None,
        "step": 2,
        "attempts": 1,
        "in_place": True,
        "nodes": [],
        "ranks": [],
        "replicas": [1],
        "reason": None,
        "for_job": None,
    }
    assert resized == lost | {"kind": "resized"}
