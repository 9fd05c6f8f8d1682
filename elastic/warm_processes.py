"""Processes started ahead of the jobs. Each node keeps a few idle Ray worker processes that
have imported torch (``elastic.process_setup``), and a job's worker actor takes one instead
of starting a process and importing torch itself (3-4 s on 2 cores); the head node also
keeps a few plain ones, and a job's supervisor takes one instead of starting a process
(0.8 s on 2 cores).

The pools are the raylets' own: the processes are started through a raylet's
``PrestartWorkers`` call with the runtime env of their :class:`Kind`, and an actor created
with the same runtime env is given one of them. A process hosts one actor and ends with it,
so no process that ran one job's code is handed to another job. An idle process holds no
Ray resources (a CPU or GPU is taken by the actor that takes it) and no GPU memory.

The scheduler's actor fills a node's pools once, when it first sees the node (:func:`fill`);
each actor that takes a process from a pool has the scheduler start another in its place
(:func:`replace_taken`). A job whose supervisor has a runtime env of its own (object-store
checkpoints, MLflow) gives its workers a different one, and Ray then starts new processes
for them, as it did before the pools."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Any

from elastic import process_setup

log = logging.getLogger(__name__)


class Kind(enum.Enum):
    """What a pool's processes are for."""

    TRAINING = "training"  # both modes' worker actors: torch imported
    SUPERVISOR = "supervisor"  # jobs' supervisors, on the head node: nothing more imported


# The runtime env of every process that trains. Ray Train's print patch is read by its own
# worker group only; it is off here so that a replica's prints go to the job's log as they
# are.
TRAINING_ENV: dict[str, Any] = {
    "env_vars": {
        process_setup.PRELOAD: process_setup.PRELOAD_TRAINING,
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    }
}
RUNTIME_ENVS: dict[Kind, dict[str, Any]] = {Kind.TRAINING: TRAINING_ENV, Kind.SUPERVISOR: {}}
# A replica's runtime env when the nodes keep no ready processes.
PLAIN_REPLICA_ENV: dict[str, Any] = {"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}
# How long an idle process of a pool is kept from Ray's idle-worker reaper (which keeps at
# most as many idle processes as the node has free CPUs).
KEEP_ALIVE_S = 30 * 24 * 3600
# A process taken from a pool is replaced this long after, once the start of the job that
# took it is over (a new process beside that start would slow it).
REPLACE_AFTER_S = 3.0
# The cluster's scheduler (elastic/cluster/capacity.py's membership watcher), a named actor
# that any process finds, a worker among them (which imports nothing of the cluster's).
SCHEDULER_NAME = "etrain-membership"
# Ray's resource that only the head node has.
HEAD_RESOURCE = "node:__internal_head__"


def pool_sizes(wanted: int, node_total: Mapping[str, float]) -> dict[Kind, int]:
    """How many processes a node keeps ready, by kind: ``wanted`` that train, but no more
    than the workers of one CPU the node can run at once (a node with no CPU of its own, a
    head that only supervises, none); on the head node, also ``wanted`` for supervisors
    (which take no CPU)."""
    sizes = {Kind.TRAINING: max(0, min(wanted, int(node_total.get("CPU", 0.0))))}
    if node_total.get(HEAD_RESOURCE):
        sizes[Kind.SUPERVISOR] = max(0, wanted)
    return {kind: n for kind, n in sizes.items() if n > 0}


def prestart(address: str, port: int, kind: Kind, count: int) -> None:
    """Ask the raylet at ``address:port`` to start ``count`` processes for its ``kind``
    pool."""
    if count <= 0:
        return
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.runtime_env import RuntimeEnv

    request = node_manager_pb2.PrestartWorkersRequest(  # type: ignore[attr-defined]
        language=common_pb2.PYTHON,  # type: ignore[attr-defined]
        runtime_env_info=get_runtime_env_info(RuntimeEnv(**RUNTIME_ENVS[kind])),
        keep_alive_duration_secs=KEEP_ALIVE_S,
        num_workers=count,
    )
    channel = init_grpc_channel(f"{address}:{port}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


def replace_taken(kind: Kind) -> None:
    """In the ``__init__`` of an actor whose process is of ``kind``: when the process came
    from its node's pool, have the cluster's scheduler start another there,
    :data:`REPLACE_AFTER_S` later. The scheduler's actor asks, not this one, which may be
    gone by then. Never raises: a pool one process short only makes a later start slower."""
    if not process_setup.from_pool or (kind == Kind.TRAINING and not process_setup.preloaded):
        return
    process_setup.from_pool = False  # one replacement per process
    try:
        import ray

        context = ray.get_runtime_context()
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=context.namespace)
        scheduler.replace_taken.remote(context.get_node_id(), kind.value)
    except Exception:
        log.exception("could not ask for a process to replace this one in the node's pool")


def prestart_on(node_id: str, kind: Kind, count: int) -> bool:
    """:func:`prestart` on the live node ``node_id``; False when it is not alive."""
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("Alive"):
            prestart(node["NodeManagerAddress"], int(node["NodeManagerPort"]), kind, count)
            return True
    return False


def fill(nodes: list[dict[str, Any]], wanted: int, namespace: str) -> set[str]:
    """Fill the pools of each live node in ``nodes`` (``ray.nodes()`` entries) that were not
    filled before; returns the nodes whose pools are filled, now or before (not those a
    raylet refused). Whether a node was filled is kept in Ray's key-value store, so that a
    scheduler started again does not fill it twice."""
    from ray.experimental import internal_kv

    filled = set()
    for node in nodes:
        sizes = pool_sizes(wanted, node.get("Resources", {}))
        if not node.get("Alive") or not sizes:
            continue
        key = f"etrain-warm-pool:{node['NodeID']}".encode()
        if internal_kv._internal_kv_put(key, b"1", overwrite=False, namespace=namespace):
            filled.add(str(node["NodeID"]))  # filled before
            continue
        try:
            for kind, count in sizes.items():
                prestart(node["NodeManagerAddress"], int(node["NodeManagerPort"]), kind, count)
        except Exception:
            log.exception("could not fill node %s's pools", node["NodeID"])
            internal_kv._internal_kv_del(key, namespace=namespace)
            continue
        filled.add(str(node["NodeID"]))
    return filled
