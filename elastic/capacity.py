"""What the live Ray cluster holds and has free, node by node (only live nodes count)."""

from __future__ import annotations

from collections.abc import Mapping

import ray
from ray._private import state as ray_state

from elastic.policy import workers_that_fit

HEAD_RESOURCE = "node:__internal_head__"


def free_per_node() -> list[dict[str, float]]:
    return list(ray_state.available_resources_per_node().values())


def total_per_node() -> list[dict[str, float]]:
    return list(ray_state.total_resources_per_node().values())


def workers_free_now(per_worker: Mapping[str, float]) -> int:
    return workers_that_fit(free_per_node(), per_worker)


def workers_ever(per_worker: Mapping[str, float]) -> int:
    """How many such workers the cluster could hold if it ran nothing else."""
    return workers_that_fit(total_per_node(), per_worker)


def head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return None
