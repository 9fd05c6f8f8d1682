"""The supervisor: a detached Ray actor that owns one job's life on the cluster.

It is the Ray face of :class:`elastic.supervisor.loop.JobLoop`, which decides everything: this
actor wires that loop to the cluster (the shared capacity watcher, the attempts' workers, the
job's checkpoint directory) and answers the workers and the service. Its event log is held
until the service acknowledges what it has stored (see :mod:`elastic.events`). It knows
nothing of HTTP or of the store.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import ray

from elastic import warm_processes
from elastic.checkpoint.directory import CheckpointDir
from elastic.checkpoint.storage import unshared_checkpoint_dir
from elastic.cluster.capacity import RayCapacity
from elastic.events import EventLog
from elastic.restart.runner import WarmPoolRunner
from elastic.supervisor.loop import JobLoop
from elastic.supervisor.plan import SupervisorPlan
from elastic.supervisor.runner import AttemptSpec

__all__ = ["Supervisor", "SupervisorPlan", "worker_config"]


def worker_config(plan: SupervisorPlan, spec: AttemptSpec) -> dict[str, Any]:
    """The train-loop config of one attempt: the job's own, and ``_elastic`` for the worker
    side (which parses it into its frozen config)."""
    return {
        **plan.train_config,
        "_elastic": {
            "train_loop": plan.train_loop,
            "attempt": spec.attempt,
            "supervisor": plan.actor_name,
            "namespace": plan.namespace,
            "checkpoint_dir": plan.checkpoint_dir,
            "every_steps": plan.every_steps,
            "keep": plan.keep,
            "max_workers": plan.max_workers,
            "resume_path": spec.resume_path,
        },
    }


@ray.remote(num_cpus=0, max_restarts=0)
class Supervisor:
    def __init__(self, plan: SupervisorPlan, first_seq: int) -> None:
        runner: Any
        if plan.ready_processes:
            warm_processes.adopt(warm_processes.Kind.SUPERVISOR)
        if plan.fault_tolerance == "in_place":
            from elastic.in_place.runner import InPlaceRunner

            runner = InPlaceRunner(asdict(plan), lambda spec: worker_config(plan, spec))
        else:
            runner = WarmPoolRunner(asdict(plan), lambda spec: worker_config(plan, spec))
        capacity = RayCapacity(plan.namespace, plan.job_id)
        self.loop = JobLoop(
            plan,
            runner,
            capacity,
            CheckpointDir(plan.checkpoint_dir),
            EventLog(first_seq),
            storage_check=lambda: unshared_checkpoint_dir(
                plan.checkpoint_dir, plan.resources_per_worker, book=capacity
            ),
        )
        self.task: asyncio.Task[None] | None = None

    # -- the reader's side -----------------------------------------------------------------

    async def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.loop.run())

    async def events(self, after: int) -> list[dict[str, Any]]:
        self.loop.deliver_overdue()
        return self.loop.events.after(after)

    async def ack(self, seq: int) -> None:
        self.loop.events.ack(seq)

    async def status(self) -> dict[str, Any]:
        return self.loop.status()

    async def cancel(self, reason: str) -> str:
        return self.loop.cancel(reason)

    # -- the workers' side -------------------------------------------------------------------

    async def register_worker(self, attempt: int, rank: int, node_id: str) -> None:
        self.loop.register_worker(attempt, rank, node_id)

    async def replica_trained(self, attempt: int, replica: int) -> None:
        self.loop.replica_trained(attempt, replica)

    async def should_pause(self, attempt: int, step: int) -> bool:
        return self.loop.should_pause(attempt, step)

    async def drain_pending(self, attempt: int) -> bool:
        return self.loop.drain_pending(attempt)

    async def record(
        self,
        kind: str,
        data: dict[str, Any],
        sender: str | None = None,
        n: int | None = None,
        at: float | None = None,
    ) -> None:
        self.loop.record(kind, data, sender, n, at)
