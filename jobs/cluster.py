"""What the cluster page shows: the Ray nodes with their CPUs/GPUs, and which job's workers
sit on which node (as each job's supervisor knows them from its workers' registrations);
and the nodes' total resources as admission reads them (``ResourceView``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray._private import state as ray_state

from elastic.cluster import capacity
from elastic.warm_processes import HEAD_RESOURCE
from jobs import launcher

log = logging.getLogger(__name__)

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


# How old a view of the nodes' totals admission may use. Ray itself takes ~3 s to declare a
# killed node dead (jobs.launcher.FAST_FAILURE_DETECTION), so a view this old adds little.
MAX_AGE_S = 2.0

NodeTotals = list[dict[str, float]]


@dataclass(frozen=True)
class _Snapshot:
    nodes: NodeTotals
    taken_at: float  # when the fetch began: the view is at least as fresh as this


class ResourceView:
    """Each live node's total resources (Ray's ``total_resources_per_node``), as of at most
    ``max_age_s`` ago. A submission's fit and memory checks read it instead of asking Ray's
    GCS twice each (a profile under load put those calls on every submission's path);
    :meth:`keep_fresh` refreshes it in the background so that they never wait for Ray.

    Totals change only when nodes join or leave. A view that misses a node that just left
    admits what may not fit (as if the node left just after); one that misses a node that just
    joined would refuse what fits, so callers about to refuse ask :meth:`refresh` first."""

    def __init__(
        self,
        fetch: Callable[[], Mapping[str, Mapping[str, float]]] = capacity.total_per_node,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self.max_age_s = max_age_s
        self._clock = clock
        self._snapshot: _Snapshot | None = None
        self._fetching = threading.Lock()  # one fetch at a time; the others take its answer

    def nodes(self) -> NodeTotals:
        """The totals, fetched at most ``max_age_s`` ago (fetched now if older)."""
        return self._fetch_unless(self._fresh)

    def refresh(self) -> NodeTotals:
        """The totals as Ray reports them now: from a fetch begun after this call was."""
        asked_at = self._clock()
        return self._fetch_unless(lambda snapshot: snapshot.taken_at >= asked_at)

    def _fresh(self, snapshot: _Snapshot) -> bool:
        return self._clock() - snapshot.taken_at <= self.max_age_s

    def _fetch_unless(self, good_enough: Callable[[_Snapshot], bool]) -> NodeTotals:
        snapshot = self._snapshot
        if snapshot is not None and good_enough(snapshot):
            return snapshot.nodes
        with self._fetching:
            snapshot = self._snapshot  # another caller may have fetched while this one waited
            if snapshot is not None and good_enough(snapshot):
                return snapshot.nodes
            taken_at = self._clock()
            nodes = [
                {name: float(amount) for name, amount in node.items()}
                for node in self._fetch().values()
            ]
            self._snapshot = _Snapshot(nodes, taken_at)
            return nodes

    async def keep_fresh(self) -> None:
        """Refresh twice per ``max_age_s``, until cancelled; a failed fetch is retried at the
        next turn (and a reader of a view too old fetches for itself meanwhile)."""
        while True:
            try:
                await asyncio.to_thread(self.refresh)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("refreshing the cluster's resources failed: %s", e)
            await asyncio.sleep(self.max_age_s / 2)
