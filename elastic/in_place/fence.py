"""Fencing a lost replica: its process is SIGKILLed as soon as the lighthouse stops hearing
from it (elastic/in_place/watchdog.py) or Ray reports its actor dead.

Why, besides the survivors' step abort (elastic/in_place/abort.py), which already lets them
go on: a hung replica (a stopped process, or a worker left behind by a dead raylet) counts
as alive to Ray, so no replacement would be placed, and it could wake with a stale view of
the job. Gloo's ``abort()`` cannot end its collectives either (measured with torch 2.14); a
killed process's sockets are closed by its kernel, which ends them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

import ray

from elastic.train.orphan import command_line

log = logging.getLogger(__name__)


def _is_replica(pid: int) -> bool:
    # A recycled pid must not be killed: the process must still be a replica actor.
    return command_line(pid).startswith(b"ray::Replica")


@ray.remote(num_cpus=0)
def _kill_on_node(pid: int) -> bool:
    if not _is_replica(pid):
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def process_of(actor: Any) -> tuple[int, str] | None:
    """The actor's (pid, node id) from Ray's actor table; None when Ray no longer knows it."""
    from ray._private.state import state

    with contextlib.suppress(Exception):
        entry = state.actor_table(actor._actor_id.hex())
        if entry and entry.get("Pid"):
            return int(entry["Pid"]), str(entry["Address"]["NodeID"])
    return None


def _node_ip(node_id: str) -> str | None:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    return None


def fence(actor: Any) -> None:
    """SIGKILL the actor's process wherever it is, then drop the actor. A process on this
    machine (the supervisor's node, or a node of a cluster sharing the host) is killed
    directly: its raylet may be the thing that died. Elsewhere a task pinned to its node
    kills it; if that node is gone, so is the process."""
    where = process_of(actor)
    if where is not None:
        pid, node_id = where
        if _node_ip(node_id) == ray.util.get_node_ip_address() and _is_replica(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            with contextlib.suppress(Exception):
                _kill_on_node.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(pid)
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
