"""How many ready processes a node keeps (elastic/warm_processes.py)."""

from __future__ import annotations

from elastic.warm_processes import HEAD_RESOURCE, Kind, pool_sizes


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
