"""What the live Ray cluster holds and has free, node by node (only live nodes count)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import ray
from ray._private import state as ray_state
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.policy import workers_that_fit

HEAD_RESOURCE = "node:__internal_head__"


def free_per_node() -> dict[str, dict[str, float]]:
    return dict(ray_state.available_resources_per_node())


def total_per_node() -> dict[str, dict[str, float]]:
    return dict(ray_state.total_resources_per_node())


def workers_free_now(per_worker: Mapping[str, float], exclude: Collection[str] = ()) -> int:
    """Workers that fit in what is free now, leaving out ``exclude`` (nodes suspected dead
    that Ray's membership has not caught up with yet)."""
    free = [r for node, r in free_per_node().items() if node not in exclude]
    return workers_that_fit(free, per_worker)


def workers_ever(per_worker: Mapping[str, float]) -> int:
    """How many such workers the cluster could hold if it ran nothing else."""
    return workers_that_fit(total_per_node().values(), per_worker)


def alive_nodes() -> set[str]:
    return {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}


def head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def on_head_node() -> dict[str, Any]:
    """Actor options that pin it to the head node, which outlives the worker nodes that may
    vanish. Hard affinity: a soft one let Ray place actors on workers when the head has no
    CPUs. Empty when no head can be found (a client connection to an odd cluster)."""
    head = head_node_id()
    if head is None:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=False)}
