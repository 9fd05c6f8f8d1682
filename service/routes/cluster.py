"""GET /v1/cluster: the nodes, their CPUs/GPUs, and which job holds which workers."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from jobs import cluster
from service.deps import CallerDep, ServicesDep, require_token
from service.schemas import ClusterJob, ClusterNode, ClusterOut, ClusterWorker

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])


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
