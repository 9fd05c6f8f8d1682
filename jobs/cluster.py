"""What the cluster page shows: the Ray nodes with their CPUs/GPUs, and which job's workers
sit on which node (as each job's supervisor knows them from its workers' registrations)."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray._private import state as ray_state

from elastic.capacity import HEAD_RESOURCE
from jobs import launcher

SHOWN_RESOURCES = ("CPU", "GPU")


def nodes() -> list[dict[str, Any]]:
    """Every node Ray knows, live ones first: id, address, alive, head, total and free CPU/GPU."""
    free = ray_state.available_resources_per_node()
    out = []
    for node in ray.nodes():
        node_id = str(node["NodeID"])
        total = node.get("Resources", {}) or {}
        available = free.get(node_id, {}) if node.get("Alive") else {}
        out.append(
            {
                "node_id": node_id,
                "address": str(node.get("NodeManagerAddress", "")),
                "alive": bool(node.get("Alive")),
                "is_head": HEAD_RESOURCE in total,
                "total": {k: float(total.get(k, 0.0)) for k in SHOWN_RESOURCES},
                "available": {k: float(available.get(k, 0.0)) for k in SHOWN_RESOURCES},
            }
        )
    out.sort(key=lambda n: (not n["alive"], not n["is_head"], n["address"], n["node_id"]))
    return out


async def worker_nodes(
    job_ids: list[str], namespace: str, timeout_s: float = 5.0
) -> dict[str, dict[int, str]]:
    """job id -> {rank: node id} of its current attempt. A job whose supervisor is gone or
    does not answer in time is left out (it holds no workers this page can name)."""

    async def one(job_id: str) -> tuple[str, dict[int, str] | None]:
        handle = await asyncio.to_thread(launcher.find_supervisor, job_id, namespace)
        if handle is None:
            return job_id, None
        try:
            status = await asyncio.wait_for(handle.status.remote(), timeout_s)
        except (launcher.SupervisorGone, TimeoutError):
            return job_id, None
        return job_id, {int(r): str(n) for r, n in status.get("worker_nodes", {}).items()}

    found = await asyncio.gather(*(one(j) for j in job_ids))
    return {job_id: placed for job_id, placed in found if placed is not None}
