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

The scheduler's actor owes a node its pools when it first sees the node, and owes it one
process for each that an actor takes (:func:`adopt`); :class:`Refills` says when
an owed process is started. A job whose supervisor has a runtime env of its own
(object-store checkpoints, MLflow) gives its workers a different one, and Ray then starts
new processes for them, as it did before the pools."""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

from elastic import process_setup

log = logging.getLogger(__name__)


class Kind(enum.Enum):
    """What a pool's processes are for."""

    TRAINING = "training"  # both modes' worker actors: torch imported
    SUPERVISOR = "supervisor"  # jobs' supervisors, on the head node: nothing more imported


# The runtime env of every process that trains. It names the set-up hook itself (as Ray's
# own ``worker_process_setup_hook`` field is passed on), so that its processes import torch
# ahead on any cluster, not only on one whose nodes were started with the hook in their
# environment (``jobs.launcher.worker_setup``: the embedded one, the Helm chart's). Ray
# Train's print patch is read by its own worker group only; it is off here so that a
# replica's prints go to the job's log as they are.
TRAINING_ENV: dict[str, Any] = {
    "env_vars": {
        WORKER_PROCESS_SETUP_HOOK_ENV_VAR: process_setup.SETUP_HOOK,
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
# An owed process is started no sooner than this after it is owed: the start of the job
# that took one is over by then (a new process beside that start would slow it), and a
# node that just joined has been given the job that wanted it.
REPLACE_AFTER_S = 3.0
# How long a node must have had a CPU free before a training process is started there.
IDLE_BEFORE_S = 5.0
# A raylet that refused to start an owed process is asked again this much later.
RETRY_AFTER_S = 30.0
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


def adopt(kind: Kind) -> None:
    """In the ``__init__`` of an actor whose process is of ``kind``: fit the process to the
    actor (:func:`process_setup.fit_threads`), and when the process came from its node's
    pool, have the cluster's scheduler owe the pool another (:class:`Refills`); the
    scheduler's actor starts it, not this one, which may be gone by then. Never raises: a
    pool one process short only makes a later start slower."""
    process_setup.fit_threads()
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


@dataclass
class Refills:
    """The processes owed to the nodes' pools, each with the time from which it may start.
    A training process starts only on a node that has had a CPU no job holds or has claimed
    for :data:`IDLE_BEFORE_S`: its torch import (seconds of a core) would otherwise be
    taken from the training there, a straggler that every synchronous step waits for, and a
    CPU freed by a lost worker is first the replacement's. A supervisor's process (no CPU
    held, little imported) starts when due."""

    owed: dict[tuple[str, Kind], list[float]] = field(default_factory=dict)
    free_since: dict[str, float] = field(default_factory=dict)  # node -> a CPU free since

    def owe(self, node: str, kind: Kind, count: int, due: float) -> None:
        if count > 0:
            self.owed.setdefault((node, kind), []).extend([due] * count)

    def take_due(
        self, now: float, alive: Collection[str], free_cpus: Mapping[str, float]
    ) -> dict[tuple[str, Kind], int]:
        """Given each node's free CPUs now (called at every look at the cluster), how many
        processes to start now, by node and kind; they are no longer owed. What a node that
        is no longer alive was owed is forgotten."""
        spare: dict[str, int] = {}
        for node, cpus in free_cpus.items():
            whole = int(cpus + 1e-9)
            if whole < 1 or node not in alive:
                self.free_since.pop(node, None)
                continue
            if now - self.free_since.setdefault(node, now) >= IDLE_BEFORE_S:
                spare[node] = whole
        for node in set(self.free_since) - set(free_cpus):
            del self.free_since[node]
        starts: dict[tuple[str, Kind], int] = {}
        for (node, kind), dues in list(self.owed.items()):
            if node not in alive:
                del self.owed[node, kind]
                continue
            count = sum(1 for due in dues if due <= now)
            if kind is Kind.TRAINING:
                count = min(count, spare.get(node, 0))
                spare[node] = spare.get(node, 0) - count
            if count == 0:
                continue
            dues.sort()
            del dues[:count]
            if not dues:
                del self.owed[node, kind]
            starts[node, kind] = count
        return starts


def first_seen(
    nodes: list[dict[str, Any]], wanted: int, namespace: str
) -> dict[str, dict[Kind, int]]:
    """The pools owed to those live ``nodes`` (``ray.nodes()`` entries) that no scheduler
    owed them before, by node. Which nodes were owed theirs is kept in Ray's key-value
    store, so that a scheduler started again does not fill a node twice."""
    from ray.experimental import internal_kv

    owed = {}
    for node in nodes:
        sizes = pool_sizes(wanted, node.get("Resources", {}))
        if not node.get("Alive") or not sizes:
            continue
        key = f"etrain-warm-pool:{node['NodeID']}".encode()
        if not internal_kv._internal_kv_put(key, b"1", overwrite=False, namespace=namespace):
            owed[str(node["NodeID"])] = sizes
    return owed


def start(
    nodes: list[dict[str, Any]], starts: Mapping[tuple[str, Kind], int]
) -> dict[tuple[str, Kind], int]:
    """Have each live node's raylet (``nodes``: ``ray.nodes()`` entries) start what
    ``starts`` says; returns what could not be started on a live node."""
    where = {
        str(n["NodeID"]): (n["NodeManagerAddress"], int(n["NodeManagerPort"]))
        for n in nodes
        if n.get("Alive")
    }
    failed = {}
    for (node, kind), count in starts.items():
        if node not in where:
            continue  # gone: its pools went with it
        try:
            prestart(*where[node], kind, count)
        except Exception:
            log.exception("could not start %d %s process(es) on node %s", count, kind.value, node)
            failed[node, kind] = count
    return failed
