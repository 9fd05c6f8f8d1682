"""Processes that train, started ahead of the jobs: each node keeps a few idle Ray worker
processes that have imported torch (``elastic.process_setup``), and a job's worker actor
takes one instead of starting a process and importing torch itself (3-4 s on 2 cores).

The pool is the raylet's own: the processes are started through its ``PrestartWorkers``
call with :data:`TRAINING_ENV` as their runtime env, and an actor created with the same
runtime env is given one of them. A process hosts one actor and ends with it, so no
process that ran one job's code is handed to another job. The processes hold no Ray
resources (a CPU or GPU is taken by the actor that takes a process) and no GPU memory.

The scheduler's actor fills a node's pool once, when it first sees the node
(:func:`fill`); each actor that takes a process from the pool asks its raylet for another
(:func:`replace_taken`). A job whose supervisor has a runtime env of its own (object-store
checkpoints, MLflow) gives its workers a different one, and Ray then starts new processes
for them, as it did before the pool."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from elastic import process_setup

log = logging.getLogger(__name__)

# The runtime env of every process that trains (both modes' worker actors). Ray Train's
# print patch is read by its own worker group only; it is off here so that a replica's
# prints go to the job's log as they are.
TRAINING_ENV: dict[str, Any] = {
    "env_vars": {
        process_setup.PRELOAD: process_setup.PRELOAD_TRAINING,
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    }
}
# How long an idle process of the pool is kept from Ray's idle-worker reaper (which keeps
# at most as many idle processes as the node has free CPUs).
KEEP_ALIVE_S = 30 * 24 * 3600
# The default number of processes each node keeps ready (the service's
# ``ETRAIN_WARM_PROCESSES_PER_NODE``).
DEFAULT_PER_NODE = 2


def pool_size(wanted: int, node_total: Mapping[str, float]) -> int:
    """How many processes a node keeps: ``wanted``, but no more than the workers of one CPU
    it can run at once (a node with no CPU of its own, a head that only supervises, none)."""
    return max(0, min(wanted, int(node_total.get("CPU", 0.0))))


def prestart(address: str, port: int, count: int) -> None:
    """Ask the raylet at ``address:port`` to start ``count`` processes for the pool."""
    if count <= 0:
        return
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.runtime_env import RuntimeEnv

    request = node_manager_pb2.PrestartWorkersRequest(  # type: ignore[attr-defined]
        language=common_pb2.PYTHON,  # type: ignore[attr-defined]
        runtime_env_info=get_runtime_env_info(RuntimeEnv(**TRAINING_ENV)),
        keep_alive_duration_secs=KEEP_ALIVE_S,
        num_workers=count,
    )
    channel = init_grpc_channel(f"{address}:{port}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


def replace_taken() -> None:
    """In a worker actor's ``__init__``: when its process came from the node's pool, ask
    the node's raylet for another, so that the pool stays as large. Never raises: a pool
    one process short only makes a later start slower."""
    if not process_setup.from_pool:
        return
    process_setup.from_pool = False  # one replacement per process
    try:
        import ray

        node = ray._private.worker.global_worker.node
        assert node is not None, "a Ray worker process is connected"
        prestart(node.node_ip_address, int(node.node_manager_port), 1)
    except Exception:
        log.exception("could not ask for a process to replace this one in the node's pool")


def fill(nodes: list[dict[str, Any]], wanted: int, namespace: str) -> list[str]:
    """Fill the pool of each live node in ``nodes`` (``ray.nodes()`` entries) that was not
    filled before; returns the nodes filled now. Whether a node was filled is kept in Ray's
    key-value store, so that a scheduler started again does not fill it twice."""
    from ray.experimental import internal_kv

    filled = []
    for node in nodes:
        count = pool_size(wanted, node.get("Resources", {}))
        if not node.get("Alive") or count == 0:
            continue
        key = f"etrain-warm-pool:{node['NodeID']}".encode()
        if not internal_kv._internal_kv_put(key, b"1", overwrite=False, namespace=namespace):
            try:
                prestart(node["NodeManagerAddress"], int(node["NodeManagerPort"]), count)
            except Exception:
                log.exception("could not fill node %s's pool", node["NodeID"])
                internal_kv._internal_kv_del(key, namespace=namespace)
                continue
            filled.append(str(node["NodeID"]))
    return filled
