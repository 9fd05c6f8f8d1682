"""GET /v1/cluster: the nodes, their CPUs/GPUs, and which job holds which workers; GET
/v1/queue: the scheduler's queue and who holds what."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Query

from jobs import cluster, queue
from service.auth import Caller
from service.deps import CallerDep, ServicesDep, require_token
from service.problems import PROBLEM_RESPONSES, Problem, documented_problem
from service.schemas import (
    ClusterJob,
    ClusterNode,
    ClusterOut,
    ClusterWorker,
    QueueEntry,
    QueueOut,
    Quota,
    RunningEntry,
)

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

# A page of the waiting jobs: a queue of thousands (a sweep, a team's backlog) answered whole
# took 50 ms a read at 1 000 entries, and the dashboard reads it every few seconds.
DEFAULT_QUEUE_PAGE = 100
MAX_QUEUE_PAGE = 1000


@router.get(
    "/cluster",
    response_model=ClusterOut,
    summary="The Ray nodes with their CPUs/GPUs, and the workers each job holds",
)
async def get_cluster(services: ServicesDep, caller: CallerDep) -> ClusterOut:
    store = services.store
    namespace = services.settings.ray_namespace
    nodes, active = await asyncio.gather(
        asyncio.to_thread(cluster.nodes), asyncio.to_thread(store.active_jobs)
    )
    # Nodes are everyone's; whose workers sit where is told only about the caller's own jobs.
    active = [j for j in active if caller.may_see(j.owner)]
    placed = await cluster.worker_nodes([j.id for j in active], namespace)
    jobs = [
        ClusterJob(
            id=j.id,
            name=j.name,
            state=j.state,
            world_size=j.world_size,
            workers=placed.get(j.id, {}),
        )
        for j in active
    ]
    on_node: dict[str, list[ClusterWorker]] = {}
    for job in jobs:
        for rank, node_id in sorted(job.workers.items()):
            on_node.setdefault(node_id, []).append(
                ClusterWorker(job_id=job.id, job_name=job.name, rank=rank)
            )
    return ClusterOut(
        nodes=[ClusterNode(**n, workers=on_node.get(n["node_id"], [])) for n in nodes],
        jobs=jobs,
    )


@router.get(
    "/queue",
    response_model=QueueOut,
    summary="The scheduler's queue (waiting jobs in the order they start, and why) and the "
    "jobs holding workers",
    description="An admin sees every entry in full. A user sees every entry's position, "
    "priority and sizes, so that they know where they stand, but the job, owner, state and "
    "reason of their own entries only (`visible`); of the quotas, their own and the default "
    "('*'). The scheduler decides the sizes; this reads what it holds now.\n\n"
    "A long queue comes in pages: `limit` waiting entries after `after_position`; "
    "`waiting` counts them all and `next_after_position` continues (null on the last page). "
    "Positions move as jobs start or are cancelled, so a page read later may repeat or skip "
    "an entry that moved. The jobs holding workers and the quotas come whole on every page.",
    responses={
        **PROBLEM_RESPONSES,
        503: documented_problem("The scheduler does not answer"),
    },
)
async def get_queue(
    services: ServicesDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_QUEUE_PAGE)] = DEFAULT_QUEUE_PAGE,
    after_position: Annotated[int, Query(ge=0)] = 0,
) -> QueueOut:
    try:
        view = await queue.queue_view(services.settings.ray_namespace, after_position, limit)
    except Exception as e:
        log.warning("the scheduler's queue could not be read: %s", e)
        raise Problem(
            503, "Scheduler not answering", f"the cluster's scheduler did not answer: {e}"
        ) from e
    ids = [e["job_id"] for e in [*view.get("queue", []), *view.get("running", [])]]
    rows = await asyncio.to_thread(services.store.names_and_states, ids)
    return visible_queue(view, caller, rows)


class NameAndState(Protocol):
    name: str
    state: str


def visible_queue(
    view: Mapping[str, Any], caller: Caller, rows: Mapping[str, NameAndState]
) -> QueueOut:
    """The scheduler's ``queue()`` as ``caller`` may see it, with each job's name and state
    from the store. Another user's entry keeps what says where the caller stands (position,
    priority, sizes) and loses what names it: its job, owner, state and reason (a reason
    names jobs and owners: "waiting: alice's quota of 4 workers is in use")."""

    def facts(entry: Mapping[str, Any]) -> dict[str, Any]:
        visible = caller.may_see(str(entry["owner"]))
        row = rows.get(str(entry["job_id"])) if visible else None
        return {
            "visible": visible,
            "job_id": entry["job_id"] if visible else None,
            "owner": entry["owner"] if visible else None,
            "name": row.name if row else None,
            "state": row.state if row else None,
        }

    waiting = [
        QueueEntry(
            position=e["position"],
            priority=e["priority"],
            reason=e.get("reason") if caller.may_see(str(e["owner"])) else None,
            expected_start_s=e.get("expected_start_s"),
            **facts(e),
        )
        for e in sorted(view.get("queue", []), key=lambda e: int(e["position"]))
    ]
    running = [
        RunningEntry(
            priority=e["priority"],
            size=e["size"],
            borrowed=e.get("borrowed", 0),
            min_workers=e["min_workers"],
            max_workers=e["max_workers"],
            **facts(e),
        )
        for e in view.get("running", [])
    ]
    quotas = view.get("quotas", {})
    shown = (
        quotas if caller.is_admin else {k: v for k, v in quotas.items() if k in (caller.user, "*")}
    )
    last = waiting[-1].position if waiting else None
    return QueueOut(
        queue=waiting,
        waiting=view["waiting"],
        next_after_position=last if last is not None and last < view["waiting"] else None,
        running=running,
        quotas={owner: Quota(**quota) for owner, quota in shown.items()},
    )
