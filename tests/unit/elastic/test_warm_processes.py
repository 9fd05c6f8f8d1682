"""How many ready processes a node keeps, and when an owed one starts
(elastic/warm_processes.py)."""

from __future__ import annotations

from elastic.warm_processes import HEAD_RESOURCE, IDLE_BEFORE_S, Kind, Refills, pool_sizes


def test_a_node_keeps_what_is_asked_to_train_but_no_more_than_its_cpus() -> None:
    assert pool_sizes(2, {"CPU": 8.0, "GPU": 2.0}) == {Kind.TRAINING: 2}
    assert pool_sizes(2, {"CPU": 1.0}) == {Kind.TRAINING: 1}
    assert pool_sizes(4, {"CPU": 2.5}) == {Kind.TRAINING: 2}


def test_the_head_node_also_keeps_processes_for_supervisors_even_with_no_cpu() -> None:
    assert pool_sizes(2, {"CPU": 2.0, HEAD_RESOURCE: 1.0}) == {
        Kind.TRAINING: 2,
        Kind.SUPERVISOR: 2,
    }
    assert pool_sizes(3, {"CPU": 0.0, HEAD_RESOURCE: 1.0}) == {Kind.SUPERVISOR: 3}


def test_a_node_with_no_cpu_or_pools_of_none_keeps_nothing() -> None:
    assert pool_sizes(2, {"CPU": 0.0}) == {}
    assert pool_sizes(2, {}) == {}
    assert pool_sizes(0, {"CPU": 8.0, HEAD_RESOURCE: 1.0}) == {}


def test_an_owed_process_starts_no_sooner_than_it_is_due() -> None:
    refills = Refills()
    refills.owe("a", Kind.SUPERVISOR, 2, due=10.0)
    refills.owe("a", Kind.SUPERVISOR, 1, due=13.0)
    assert refills.take_due(9.9, {"a"}, {"a": 0.0}) == {}
    assert refills.take_due(10.0, {"a"}, {"a": 0.0}) == {("a", Kind.SUPERVISOR): 2}
    assert refills.take_due(12.0, {"a"}, {"a": 0.0}) == {}
    assert refills.take_due(13.0, {"a"}, {"a": 0.0}) == {("a", Kind.SUPERVISOR): 1}
    assert refills.owed == {}


def test_a_training_process_waits_until_its_node_has_had_a_cpu_free_for_a_while() -> None:
    refills = Refills()
    refills.owe("a", Kind.TRAINING, 2, due=0.0)
    refills.owe("b", Kind.TRAINING, 1, due=0.0)
    # Node a's CPUs are all held (a job trains there); b has half a CPU: neither starts.
    assert refills.take_due(5.0, {"a", "b"}, {"a": 0.0, "b": 0.5}) == {}
    # One of a's CPUs is freed (its job ended, or a worker of it was lost: its replacement
    # may come for the CPU): nothing starts until it has stayed free for IDLE_BEFORE_S.
    assert refills.take_due(6.0, {"a", "b"}, {"a": 1.0, "b": 0.5}) == {}
    assert refills.take_due(6.0 + IDLE_BEFORE_S - 0.1, {"a", "b"}, {"a": 1.0, "b": 0.5}) == {}
    # Taken again meanwhile: the wait starts over when it is freed again.
    assert refills.take_due(6.0 + IDLE_BEFORE_S - 0.05, {"a", "b"}, {"a": 0.0, "b": 0.5}) == {}
    assert refills.take_due(20.0, {"a", "b"}, {"a": 1.0, "b": 0.5}) == {}
    # One free CPU on a, free long enough: one of its two starts; the other waits for a CPU.
    later = 20.0 + IDLE_BEFORE_S
    assert refills.take_due(later, {"a", "b"}, {"a": 1.0, "b": 3.0}) == {("a", Kind.TRAINING): 1}
    # b's CPUs have been free for long enough too, and a now has two: the rest start.
    again = later + IDLE_BEFORE_S
    assert refills.take_due(again, {"a", "b"}, {"a": 2.0, "b": 3.0}) == {
        ("a", Kind.TRAINING): 1,
        ("b", Kind.TRAINING): 1,
    }
    assert refills.owed == {}


def test_a_node_s_free_cpus_are_shared_by_what_it_is_owed_and_a_dead_node_is_forgotten() -> None:
    refills = Refills()
    refills.owe("a", Kind.TRAINING, 3, due=0.0)
    refills.owe("a", Kind.SUPERVISOR, 2, due=0.0)
    refills.owe("gone", Kind.TRAINING, 2, due=0.0)
    free = {"a": 2.0, "gone": 8.0}
    # A supervisor's process holds no CPU: both start when due, idle node or not.
    assert refills.take_due(1.0, {"a"}, free) == {("a", Kind.SUPERVISOR): 2}
    # Two CPUs free for long enough: two of the three training processes start.
    assert refills.take_due(1.0 + IDLE_BEFORE_S, {"a"}, free) == {("a", Kind.TRAINING): 2}
    assert refills.owed == {("a", Kind.TRAINING): [0.0]}
