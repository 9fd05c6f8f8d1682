"""Runs one attempt: a Ray Train worker group at a given size, from a given checkpoint.

The supervisor's loop knows only :class:`AttemptRunner`; :class:`RayTrainRunner` is the one
that places work on the cluster.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import ray.train

from elastic import capacity
from elastic.attempt import AttemptOutcome
from elastic.worker_logs import forward_output

# How long Ray Train may take to place and start a worker group before its attempt fails
# (Ray's default is 60 s). It sits above the supervisor's own start-up bound
# (``job_loop.Timing.start_s``), which fires first and tells a job that never started (it
# lost a race for capacity) to wait queued, instead of counting a failed attempt.
WORKER_GROUP_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class AttemptSpec:
    """Everything one attempt needs to start, besides the job's fixed plan."""

    attempt: int
    world_size: int
    resume_path: str | None


class AttemptRunner(Protocol):
    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        """Start the attempt and wait for it to end."""
        ...

    def stop(self) -> None:
        """End the running attempt now (its ``run`` then returns)."""
        ...

    def leave(self, ranks: set[int]) -> set[int]:
        """In place only: these workers leave the running attempt (their nodes are
        draining) while the others train on. Returns those told."""
        ...


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def outcome_of(error: BaseException) -> AttemptOutcome:
    """One readable line from a Ray Train failure (whose text carries whole tracebacks),
    and which ranks died rather than raised."""
    failures: dict[int, BaseException] = getattr(error, "worker_failures", None) or {}
    dead = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
    if failures:
        rank, exc = sorted(failures.items())[0]
        line = _last_line(str(exc))
        if not isinstance(exc, ray.exceptions.RayError):  # Ray's own text names the type
            line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
        text = f"rank {rank}: {line}"
    else:
        text = _last_line(str(error)) or type(error).__name__
    return AttemptOutcome(text[:1000], dead)


def resolve(entrypoint: str) -> Any:
    module, _, name = entrypoint.partition(":")
    return getattr(importlib.import_module(module), name)


def run_train_loop(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: the job's ``train_loop(config, ctx)``, its output
    forwarded to the job's log."""
    from elastic.loop import run_with_context  # torch: on workers only

    meta = config["_elastic"]
    supervisor = ray.get_actor(meta["supervisor"], namespace=meta["namespace"])
    rank = ray.train.get_context().get_world_rank()

    def send(lines: list[list[Any]]) -> None:
        supervisor.record.remote("log", {"attempt": meta["attempt"], "rank": rank, "lines": lines})

    train_loop = resolve(meta["train_loop"])
    with forward_output(send):
        run_with_context(train_loop, config)


@ray.remote(num_cpus=0)
class FitActor:
    """Runs one Ray Train ``fit()``. Killing this actor ends the attempt: the Train controller
    it owns dies with it, and the workers with the controller."""

    def fit(self, plan: dict[str, Any], world_size: int, config: dict[str, Any]) -> AttemptOutcome:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from elastic.process_group import NodeBoundTorchConfig

        resources = plan["resources_per_worker"]
        trainer = TorchTrainer(
            run_train_loop,
            train_loop_config=config,
            torch_config=NodeBoundTorchConfig(
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
                # Restarts are the supervisor's: it re-sizes the job between attempts. A
                # worker group that cannot start fails the attempt instead of retrying.
                failure_config=FailureConfig(  # type: ignore[call-arg]  # v1 stubs lack them
                    max_failures=0, controller_failure_limit=0, max_preemption_failures=0
                ),
            ),
        )
        try:
            trainer.fit()
        except Exception as e:
            return outcome_of(e)
        return AttemptOutcome()


class RayTrainRunner:
    """Each attempt is a :class:`FitActor` on the head node, owned by the supervisor (so
    that the attempt ends with it)."""

    def __init__(self, plan: dict[str, Any], config_for: Any) -> None:
        self.plan = plan
        self.config_for = config_for  # AttemptSpec -> the train-loop config
        self.actor: Any = None
        self.stopped = False

    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        options: dict[str, Any] = {
            # The Train controller lives beside its runner: keep both off nodes that may go.
            **capacity.on_head_node(),
            "runtime_env": {
                "env_vars": {
                    # Ray Train would route print() to its own logger; the job's log wants them.
                    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(WORKER_GROUP_START_TIMEOUT_S),
                    # Its watcher is one more process to start on the head per attempt, and
                    # drains are the supervisor's (the job pauses at its next step).
                    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
                }
            },
        }
        self.stopped = False
        self.actor = FitActor.options(**options).remote()  # type: ignore[attr-defined]
        call = self.actor.fit.remote(self.plan, spec.world_size, self.config_for(spec))
        try:
            outcome: AttemptOutcome = await call
            return outcome
        except ray.exceptions.RayActorError as e:
            return AttemptOutcome(None if self.stopped else f"the attempt's driver died: {e}")
        finally:
            self.stop()

    def leave(self, ranks: set[int]) -> set[int]:
        return set()  # a restart leaves a draining node by pausing at a checkpoint

    def stop(self) -> None:
        self.stopped = True
        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
            self.actor = None
