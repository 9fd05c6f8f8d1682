"""The supervisor: a detached Ray actor that owns one job's life on the cluster.

It sizes the job, runs Ray Train attempts from the latest good checkpoint, restarts after
failures, and keeps an append-only, numbered log of what happened. Whoever reads that log
(the service) acknowledges what it has stored; nothing is dropped before that, so the
log survives restarts of its reader. It knows nothing of HTTP or of the store.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic import capacity
from elastic.checkpoints import CheckpointDir, CheckpointInfo
from elastic.policy import choose_world_size

log = logging.getLogger(__name__)

CAPACITY_POLL_S = 1.0


@dataclass
class SupervisorPlan:
    job_id: str
    train_loop: str  # "module:function" run by every Ray Train worker
    train_config: dict[str, Any]
    min_workers: int
    max_workers: int
    resources_per_worker: dict[str, float]
    backend: str  # "gloo" or "nccl"
    checkpoint_dir: str
    every_steps: int
    keep: int
    max_restarts: int
    actor_name: str
    namespace: str
    # A lost peer must surface as an error in seconds, not after torch's 30-minute default.
    collective_timeout_s: int = 60
    transitions: dict[str, list[str]] = field(default_factory=dict)
    initial_state: str = "queued"


def _summarize(error: BaseException) -> str:
    """One readable line from a Ray Train failure (whose text carries whole tracebacks)."""
    failures = getattr(error, "worker_failures", None)
    if failures:
        rank, exc = sorted(failures.items())[0]
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        text = f"rank {rank}: {lines[-1] if lines else type(exc).__name__}"
    else:
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
        text = lines[-1] if lines else type(error).__name__
    return text[:1000]


def resolve(entrypoint: str) -> Any:
    module, _, name = entrypoint.partition(":")
    return getattr(importlib.import_module(module), name)


@ray.remote(num_cpus=0)
class AttemptRunner:
    """Runs one Ray Train ``fit()``. Killing this actor ends the attempt: the Train controller
    it owns dies with it, and the workers with the controller."""

    def fit(self, plan: dict[str, Any], world_size: int, config: dict[str, Any]) -> str | None:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        resources = plan["resources_per_worker"]
        trainer = TorchTrainer(
            resolve(plan["train_loop"]),
            train_loop_config=config,
            torch_config=TorchConfig(
                backend=plan["backend"], timeout_s=plan["collective_timeout_s"]
            ),
            scaling_config=ScalingConfig(
                num_workers=world_size,
                use_gpu=resources.get("GPU", 0) > 0,
                resources_per_worker=resources,
            ),
            run_config=RunConfig(
                name=f"{plan['job_id']}-attempt-{config['_elastic']['attempt']}",
                storage_path=f"{plan['checkpoint_dir']}/_ray",
                # Restarts are the supervisor's: it re-sizes the job between attempts.
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        try:
            trainer.fit()
        except Exception as e:
            return _summarize(e)
        return None


@ray.remote(num_cpus=0, max_restarts=0)
class Supervisor:
    def __init__(self, plan: SupervisorPlan, first_seq: int) -> None:
        self.plan = plan
        self.state = plan.initial_state
        self.next_seq = first_seq
        self.pending: list[dict[str, Any]] = []  # events not yet acknowledged
        self.attempt = 0
        self.world_size = 0
        self.last_step = 0
        self.cancelled = False
        self.runner: Any = None
        self.task: asyncio.Task[None] | None = None
        self.checkpoints = CheckpointDir(plan.checkpoint_dir)

    # -- the reader's side -------------------------------------------------------------

    async def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._main())

    async def events(self, after: int) -> list[dict[str, Any]]:
        return [e for e in self.pending if e["seq"] > after]

    async def ack(self, seq: int) -> None:
        self.pending = [e for e in self.pending if e["seq"] > seq]

    async def status(self) -> dict[str, Any]:
        return {"state": self.state, "attempt": self.attempt, "world_size": self.world_size,
                "step": self.last_step, "pending": len(self.pending)}

    async def cancel(self, reason: str) -> str:
        if self.state in ("succeeded", "failed", "cancelled"):
            return self.state
        self.cancelled = True
        self._end_attempt()
        self._set_state("cancelled", reason=reason)
        return self.state

    # -- the workers' side ---------------------------------------------------------------

    async def record(self, kind: str, data: dict[str, Any]) -> None:
        if data.get("attempt") != self.attempt or self.cancelled:
            return  # late news from an attempt that has already ended
        if kind == "metrics":
            if self.state in ("starting", "recovering"):
                self._set_state("running", world_size=data.get("world_size"))
            self.last_step = int(data.get("step", self.last_step))
        self._emit(kind, data)

    # -- the loop ------------------------------------------------------------------------

    async def _main(self) -> None:
        try:
            await self._drive()
        except Exception as e:  # a bug here must still end the job where a user sees it
            log.exception("supervisor of %s failed", self.plan.job_id)
            if self.state not in ("succeeded", "failed", "cancelled"):
                self._set_state("failed", reason=f"supervisor error: {e!r}")

    async def _drive(self) -> None:
        restarts = 0
        while True:
            size = await self._wait_for_capacity()
            if self.cancelled:
                return
            checkpoint = await asyncio.to_thread(self._latest_checkpoint)
            self.attempt += 1
            self.world_size = size
            if self.state == "queued":
                self._set_state("starting", world_size=size)
            self._emit("attempt_started", {
                "attempt": self.attempt, "world_size": size,
                "checkpoint_step": checkpoint.step if checkpoint else None,
            })
            error = await self._run_attempt(size, checkpoint)
            if self.cancelled:
                return
            if error is None:
                self._set_state("succeeded", step=self.last_step)
                return
            if restarts >= self.plan.max_restarts:
                self._set_state(
                    "failed",
                    reason=f"{error} (gave up after {restarts} restart"
                    f"{'' if restarts == 1 else 's'}; max_restarts is {self.plan.max_restarts})",
                )
                return
            restarts += 1
            self._set_state("recovering", reason=error, restarts=restarts)

    async def _wait_for_capacity(self) -> int:
        per_worker = self.plan.resources_per_worker
        while not self.cancelled:
            size = choose_world_size(
                self.plan.min_workers, self.plan.max_workers, capacity.workers_free_now(per_worker)
            )
            if size is not None:
                return size
            await asyncio.sleep(CAPACITY_POLL_S)
        return 0

    def _latest_checkpoint(self) -> CheckpointInfo | None:
        info, skipped = self.checkpoints.latest_valid()
        for bad, why in skipped:
            self._emit("checkpoint_corrupt", {"step": bad.step, "path": bad.path, "reason": why})
        return info

    async def _run_attempt(self, size: int, checkpoint: CheckpointInfo | None) -> str | None:
        plan = self.plan
        config = {
            **plan.train_config,
            "_elastic": {
                "attempt": self.attempt,
                "supervisor": plan.actor_name,
                "namespace": plan.namespace,
                "checkpoint_dir": plan.checkpoint_dir,
                "every_steps": plan.every_steps,
                "keep": plan.keep,
                "resume_path": checkpoint.path if checkpoint else None,
            },
        }
        options: dict[str, Any] = {}
        head = capacity.head_node_id()
        if head:
            # The controller lives beside its runner: keep both off nodes that may vanish.
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
        self.runner = AttemptRunner.options(**options).remote()  # type: ignore[attr-defined]
        try:
            return await self.runner.fit.remote(asdict(plan), size, config)
        except ray.exceptions.RayActorError as e:
            return None if self.cancelled else f"the attempt's driver died: {e}"
        finally:
            self._end_attempt()

    def _end_attempt(self) -> None:
        if self.runner is not None:
            ray.kill(self.runner, no_restart=True)
            self.runner = None

    # -- the log -------------------------------------------------------------------------

    def _set_state(self, target: str, reason: str | None = None, **extra: Any) -> None:
        allowed = self.plan.transitions.get(self.state)
        if allowed is not None and target not in allowed:
            raise RuntimeError(f"illegal transition {self.state} -> {target}")
        previous, self.state = self.state, target
        self._emit("state", {"state": target, "previous": previous, "reason": reason, **extra})

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        self.pending.append({"seq": self.next_seq, "kind": kind, "time": time.time(),
                             "data": data})
        self.next_seq += 1
