"""The supervisor: a detached Ray actor that owns one job's life on the cluster.

It sizes the job, runs Ray Train attempts from the latest good checkpoint, watches node
membership while an attempt runs, restarts smaller after a loss and bigger when capacity
returns, and keeps an append-only, numbered log of what happened. Whoever reads that log
(the service) acknowledges what it has stored; nothing is dropped before that, so the log
survives restarts of its reader. It knows nothing of HTTP or of the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import ray.train

from elastic import capacity
from elastic.checkpoints import CheckpointDir, CheckpointInfo
from elastic.policy import below_min_for_too_long, choose_world_size, grow_target
from elastic.worker_logs import forward_output

log = logging.getLogger(__name__)

CAPACITY_POLL_S = 0.5
MEMBERSHIP_POLL_S = 0.5
# A node whose workers died is left out of sizing until Ray's membership marks it dead,
# or for this long: Ray takes seconds to notice a silent node, and a restart that tried to
# place workers there would wait for them until Ray Train's start-up timeout.
SUSPECT_TTL_S = 60.0
# After an attempt ends, how long to wait for its survivors' resources to be released.
RELEASE_WAIT_S = 3.0
TERMINAL = ("succeeded", "failed", "cancelled")


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
    min_workers_grace_s: float
    actor_name: str
    namespace: str
    # A lost peer must surface as an error in seconds, not after torch's 30-minute default.
    collective_timeout_s: int = 30
    transitions: dict[str, list[str]] = field(default_factory=dict)
    initial_state: str = "queued"


@dataclass
class AttemptOutcome:
    error: str | None = None
    dead_ranks: list[int] = field(default_factory=list)


@dataclass
class Recovery:
    """What the next attempt's first step completes: a restart after a loss or a failure,
    or a planned resize at a checkpoint boundary."""

    kind: str  # "loss", "failure" or "grow"
    from_world: int
    reached_step: int  # the furthest step the ended attempt reported
    checkpoint_step: int | None  # the newest checkpoint then; the one restored, once known
    since: float  # when the loss was seen, or the pause began

    @property
    def steps_redone(self) -> int:
        return max(0, self.reached_step - (self.checkpoint_step or 0))


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
    train_loop = resolve(meta["train_loop"])
    supervisor = ray.get_actor(meta["supervisor"], namespace=meta["namespace"])
    rank = ray.train.get_context().get_world_rank()

    def send(lines: list[list[Any]]) -> None:
        supervisor.record.remote("log", {"attempt": meta["attempt"], "rank": rank, "lines": lines})

    with forward_output(send):
        run_with_context(train_loop, config)


@ray.remote(num_cpus=0)
class AttemptRunner:
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
                # Restarts are the supervisor's: it re-sizes the job between attempts.
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        try:
            trainer.fit()
        except Exception as e:
            return outcome_of(e)
        return AttemptOutcome()


@ray.remote(num_cpus=0, max_restarts=0)
class Supervisor:
    def __init__(self, plan: SupervisorPlan, first_seq: int) -> None:
        self.plan = plan
        self.state = plan.initial_state
        self.next_seq = first_seq
        self.pending: list[dict[str, Any]] = []  # events not yet acknowledged
        self.attempt = 0
        self.world_size = 0
        self.last_step = 0  # the highest step reported in the current attempt
        self.checkpoint_step: int | None = None
        self.worker_nodes: dict[int, str] = {}
        self.suspects: dict[str, float] = {}
        self.recovery: Recovery | None = None
        self.loss_seen_at: float | None = None
        self.resize_to: int | None = None
        self.paused_at: int | None = None
        self.ended_reason: str | None = None  # why the watcher ended the attempt
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
        return {
            "state": self.state,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "step": self.last_step,
            "pending": len(self.pending),
            "worker_nodes": dict(self.worker_nodes),
        }

    async def cancel(self, reason: str) -> str:
        if self.state in TERMINAL:
            return self.state
        self.cancelled = True
        self._end_attempt()
        self._set_state("cancelled", reason=reason)
        return self.state

    # -- the workers' side ---------------------------------------------------------------

    async def register_worker(self, attempt: int, rank: int, node_id: str) -> None:
        if attempt == self.attempt:
            self.worker_nodes[rank] = node_id

    async def should_pause(self, attempt: int, step: int) -> bool:
        """Asked by rank 0 right after each checkpoint: stop here so the job can grow?"""
        if attempt != self.attempt or self.resize_to is None or self.cancelled:
            return False
        self.paused_at = step
        return True

    async def record(self, kind: str, data: dict[str, Any]) -> None:
        if data.get("attempt") != self.attempt or self.cancelled:
            return  # late news from an attempt that has already ended
        if kind == "metrics":
            if self.state in ("starting", "recovering"):
                self._set_state("running", world_size=data.get("world_size"))
            if self.recovery is not None:
                self._complete_recovery()
            self.last_step = max(self.last_step, int(data.get("step", 0)))
        elif kind == "checkpoint_saved":
            self.checkpoint_step = int(data["step"])
            self.last_step = max(self.last_step, self.checkpoint_step)
        self._emit(kind, data)

    # -- the loop ------------------------------------------------------------------------

    async def _main(self) -> None:
        try:
            await self._drive()
        except Exception as e:  # a bug here must still end the job where a user sees it
            log.exception("supervisor of %s failed", self.plan.job_id)
            if self.state not in TERMINAL:
                self._set_state("failed", reason=f"supervisor error: {e!r}")

    async def _drive(self) -> None:
        plan = self.plan
        restarts = 0
        while True:
            size = await self._wait_for_capacity()
            if size is None or self.cancelled:
                return
            checkpoint = await asyncio.to_thread(self._latest_checkpoint)
            self._begin_attempt(size, checkpoint)
            outcome = await self._run_attempt(size, checkpoint)
            if self.cancelled:
                return
            if outcome.error is None and self.paused_at is not None:
                self.recovery = Recovery("grow", size, self.paused_at, self.paused_at, time.time())
                await self._wait_for_release(self.resize_to or size)
                continue
            if outcome.error is None:
                if self.state in ("starting", "recovering"):
                    # A custom loop may finish without ever reporting a step: it did run.
                    self._set_state("running", world_size=size)
                self._set_state("succeeded", step=self.last_step)
                return
            seen = self.loss_seen_at or time.time()
            lost = self._lost_nodes(outcome.dead_ranks)
            for node in lost:
                self.suspects[node] = seen
            self.recovery = Recovery(
                "loss" if lost else "failure", size, self.last_step, self.checkpoint_step, seen
            )
            if lost:
                self._emit(
                    "worker_lost",
                    {
                        "kind": "worker_lost",
                        **self._recovery_fields(None),
                        "nodes": sorted(lost),
                        "ranks": sorted(r for r, n in self.worker_nodes.items() if n in lost),
                        "reason": outcome.error,
                    },
                )
            if restarts >= plan.max_restarts:
                self._set_state(
                    "failed",
                    reason=f"{outcome.error} (gave up after {restarts} restart"
                    f"{'' if restarts == 1 else 's'}; max_restarts is {plan.max_restarts})",
                )
                return
            restarts += 1
            self._set_state("recovering", reason=outcome.error, restarts=restarts)
            await self._wait_for_release(size - len(lost))

    def _begin_attempt(self, size: int, checkpoint: CheckpointInfo | None) -> None:
        if self.recovery is not None:
            self.recovery.checkpoint_step = checkpoint.step if checkpoint else None
        self.attempt += 1
        self.world_size = size
        self.worker_nodes = {}
        self.loss_seen_at = None
        self.resize_to = None
        self.paused_at = None
        self.last_step = checkpoint.step if checkpoint else 0
        self.checkpoint_step = checkpoint.step if checkpoint else None
        if self.state == "queued":
            self._set_state("starting", world_size=size)
        self._emit(
            "attempt_started",
            {
                "attempt": self.attempt,
                "world_size": size,
                "checkpoint_step": checkpoint.step if checkpoint else None,
            },
        )

    async def _wait_for_capacity(self) -> int | None:
        per_worker = self.plan.resources_per_worker
        began = time.monotonic()
        while not self.cancelled:
            fit = await asyncio.to_thread(self._fit_now)
            size = choose_world_size(self.plan.min_workers, self.plan.max_workers, fit)
            if size is not None:
                return size
            waited = time.monotonic() - began
            # A queued job waits its turn; a job that lost workers has a grace period.
            if self.state == "recovering" and below_min_for_too_long(
                waited, self.plan.min_workers_grace_s
            ):
                self._set_state(
                    "failed",
                    reason=f"only {fit} worker{'' if fit == 1 else 's'} of {per_worker} fit, "
                    f"below min_workers ({self.plan.min_workers}), for longer than the "
                    f"{self.plan.min_workers_grace_s:g} s grace period",
                )
                return None
            await asyncio.sleep(CAPACITY_POLL_S)
        return None

    async def _wait_for_release(self, expected: int) -> None:
        """Give the ended attempt's surviving workers a moment to hand back their resources,
        so the restart is not needlessly small."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        want = min(self.plan.max_workers, expected)
        while time.monotonic() < deadline and not self.cancelled:
            if await asyncio.to_thread(self._fit_now) >= want:
                return
            await asyncio.sleep(0.1)

    def _fit_now(self) -> int:
        alive = capacity.alive_nodes()
        now = time.time()
        self.suspects = {
            n: t for n, t in self.suspects.items() if n in alive and now - t < SUSPECT_TTL_S
        }
        return capacity.workers_free_now(self.plan.resources_per_worker, exclude=self.suspects)

    def _lost_nodes(self, dead_ranks: list[int]) -> set[str]:
        alive = capacity.alive_nodes()
        gone = {n for n in self.worker_nodes.values() if n not in alive}
        return gone | {self.worker_nodes[r] for r in dead_ranks if r in self.worker_nodes}

    def _latest_checkpoint(self) -> CheckpointInfo | None:
        info, skipped = self.checkpoints.latest_valid()
        for bad, why in skipped:
            self._emit("checkpoint_corrupt", {"step": bad.step, "path": bad.path, "reason": why})
        return info

    async def _run_attempt(self, size: int, checkpoint: CheckpointInfo | None) -> AttemptOutcome:
        plan = self.plan
        config = {
            **plan.train_config,
            "_elastic": {
                "train_loop": plan.train_loop,
                "attempt": self.attempt,
                "supervisor": plan.actor_name,
                "namespace": plan.namespace,
                "checkpoint_dir": plan.checkpoint_dir,
                "every_steps": plan.every_steps,
                "keep": plan.keep,
                "max_workers": plan.max_workers,
                "resume_path": checkpoint.path if checkpoint else None,
            },
        }
        options: dict[str, Any] = {
            # The Train controller lives beside its runner: keep both off nodes that may go.
            **capacity.on_head_node(),
            # Ray Train would route print() to its own logger; the job's log wants the lines.
            "runtime_env": {"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
        }
        self.runner = AttemptRunner.options(**options).remote()  # type: ignore[attr-defined]
        watcher = asyncio.get_running_loop().create_task(self._watch(size))
        try:
            outcome: AttemptOutcome = await self.runner.fit.remote(asdict(plan), size, config)
            return outcome
        except ray.exceptions.RayActorError as e:
            if self.cancelled:
                return AttemptOutcome()
            return AttemptOutcome(self.ended_reason or f"the attempt's driver died: {e}")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            self._end_attempt()

    async def _watch(self, size: int) -> None:
        """While an attempt runs: end it as soon as Ray's membership loses one of its nodes
        (a silent loss raises no collective error until its timeout), and ask for a resize
        at the next checkpoint when capacity for more workers appears."""
        self.ended_reason = None
        while True:
            await asyncio.sleep(MEMBERSHIP_POLL_S)
            alive = await asyncio.to_thread(capacity.alive_nodes)
            gone = {n for n in self.worker_nodes.values() if n not in alive}
            if gone:
                self.loss_seen_at = self.loss_seen_at or time.time()
                self.ended_reason = (
                    f"node{'s' if len(gone) > 1 else ''} "
                    f"{', '.join(sorted(g[:12] for g in gone))} left the cluster"
                )
                self._end_attempt()
                return
            if (
                self.state == "running"
                and self.recovery is None
                and self.resize_to is None
                and size < self.plan.max_workers
            ):
                free = await asyncio.to_thread(self._fit_now)
                self.resize_to = grow_target(size, self.plan.max_workers, free)

    def _end_attempt(self) -> None:
        if self.runner is not None:
            ray.kill(self.runner, no_restart=True)
            self.runner = None

    # -- the log -------------------------------------------------------------------------

    def _recovery_fields(self, to_world: int | None) -> dict[str, Any]:
        r = self.recovery
        assert r is not None
        return {
            "from_world": r.from_world,
            "to_world": to_world,
            "checkpoint_step": r.checkpoint_step,
            "steps_redone": r.steps_redone,
            "recovery_seconds": None if to_world is None else round(time.time() - r.since, 3),
        }

    def _complete_recovery(self) -> None:
        r = self.recovery
        assert r is not None
        fields = self._recovery_fields(self.world_size)
        if r.kind != "grow" and r.checkpoint_step is not None:
            self._emit("restored", {"kind": "restored", **fields})
        if r.from_world != self.world_size:
            self._emit("resized", {"kind": "resized", **fields})
        self.recovery = None

    def _set_state(self, target: str, reason: str | None = None, **extra: Any) -> None:
        allowed = self.plan.transitions.get(self.state)
        if allowed is not None and target not in allowed:
            raise RuntimeError(f"illegal transition {self.state} -> {target}")
        previous, self.state = self.state, target
        self._emit("state", {"state": target, "previous": previous, "reason": reason, **extra})

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        self.pending.append({"seq": self.next_seq, "kind": kind, "time": time.time(), "data": data})
        self.next_seq += 1
