"""How many ready processes a node keeps (elastic/warm_processes.py)."""

from __future__ import annotations

from elastic.warm_processes import pool_size


def test_a_node_keeps_what_is_asked_but_no_more_than_its_cpus() -> None:
    assert pool_size(2, {"CPU": 8.0, "GPU": 2.0}) == 2
    assert pool_size(2, {"CPU": 1.0}) == 1
    assert pool_size(4, {"CPU": 2.5}) == 2


def test_a_node_with_no_cpu_or_a_pool_of_none_keeps_nothing() -> None:
    assert pool_size(2, {"CPU": 0.0}) == 0
    assert pool_size(2, {}) == 0
    assert pool_size(0, {"CPU": 8.0}) == 0

