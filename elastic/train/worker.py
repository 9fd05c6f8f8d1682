"""What a training worker knows about its job: rank, world, where to checkpoint, whom to tell."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Ray is imported only where a supervisor is involved: a standalone worker (a process group
# formed by hand, the GPU checks in tests/gpu) runs where Ray is not installed.
import torch

from elastic.arrivals import Outbox
from elastic.checkpoint.directory import CheckpointDir
from elastic.train import mlflow_log
from elastic.train.tensorboard import TensorBoardLog, resumed_step
from elastic.train.worker_config import WorkerConfig

log = logging.getLogger(__name__)

# How often rank 0 asks its supervisor whether a node of the attempt is draining: a drain
# notice gives seconds to minutes, and the job pauses at the first step after the answer.
DRAIN_POLL_S = 0.5


@dataclass
class WorkerContext:
    """A worker's rank and world, and the job's settings from its :class:`WorkerConfig`."""

    rank: int
    world_size: int
    config: WorkerConfig
    supervisor: Any  # the supervisor's actor handle, or None when run without one
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Without a supervisor (a worker started by hand, a test), events are kept here.
    local_events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # The last step whose optimizer step finished (the loop keeps it current).
    completed_step: int = 0
    # Rank 0 of a job's attempt draws what it reports into TensorBoard event files.
    tensorboard: TensorBoardLog | None = None
    # ... and into the job's MLflow run, when the service has a tracking URI.
    mlflow: mlflow_log.MlflowLog | None = None
    checkpoints: CheckpointDir = field(init=False)
    outbox: Outbox | None = field(init=False)
    # Set by the supervisor's word that the attempt failed elsewhere: collectives still
    # waiting give up (elastic.train.process_group.all_reduce).
    abandoned: threading.Event = field(default_factory=threading.Event, init=False)
    # Wraps the formation of each further process group of the attempt (a collective of
    # every rank), so that the supervisor's word reaches a formation waiting on a lost peer
    # too (``elastic/restart/worker.py``); nothing where no one gives attempts up.
    forming: Callable[[], contextlib.AbstractContextManager[None]] = field(
        default=contextlib.nullcontext, init=False
    )
    _drain_noticed: threading.Event = field(default_factory=threading.Event, init=False)
    _closed: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        self.checkpoints = CheckpointDir(self.config.checkpoint_dir)
        self.outbox = None if self.supervisor is None else Outbox(self.supervisor)

    @property
    def attempt(self) -> int:
        return self.config.attempt

    @property
    def every_steps(self) -> int:
        return self.config.every_steps

    @property
    def keep(self) -> int:
        return self.config.keep

    @property
    def max_workers(self) -> int:
        return self.config.max_workers

    @property
    def resume_path(self) -> str | None:
        return self.config.resume_path

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        rank: int | None = None,
        world_size: int | None = None,
        device: torch.device | None = None,
    ) -> WorkerContext:
        """The context of a worker placed by its supervisor. A warm worker
        (``elastic/restart/worker.py``) is told its rank, world and device; without them they are
        read from Ray Train's context (a loop run under a ``TorchTrainer`` of its own)."""
        if rank is None or world_size is None:
            from ray.train import get_context
            from ray.train.torch import get_device

            train = get_context()
            rank, world_size = train.get_world_rank(), train.get_world_size()
            device = device or get_device()
        import ray

        meta = WorkerConfig.from_dict(config["_elastic"])
        supervisor = None
        if meta.supervisor:
            supervisor = ray.get_actor(meta.supervisor, namespace=meta.namespace)
        worker = cls(
            rank=rank,
            world_size=world_size,
            config=meta,
            supervisor=supervisor,
            device=device or torch.device("cpu"),
        )
        if supervisor is not None:
            supervisor.register_worker.remote(
                meta.attempt, rank, ray.get_runtime_context().get_node_id()
            )
            if worker.rank == 0:
                worker.tensorboard = TensorBoardLog(
                    meta.checkpoint_dir,
                    meta.attempt,
                    worker.world_size,
                    resumed_step(meta.resume_path),
                )
                worker.mlflow = mlflow_log.for_worker(
                    config, meta.attempt, worker.world_size, resumed_step(meta.resume_path)
                )
                worker.watch_for_drain()
        return worker

    @classmethod
    def standalone(
        cls,
        rank: int,
        world_size: int,
        checkpoint_dir: str,
        every_steps: int,
        max_workers: int | None = None,
        resume_path: str | None = None,
        device: torch.device | None = None,
        keep: int = 3,
        attempt: int = 1,
    ) -> WorkerContext:
        """A worker in a process group formed without Ray (``torch.multiprocessing``, a
        debugger): the same training code runs, and its events stay in ``local_events``."""
        config = WorkerConfig(
            checkpoint_dir=checkpoint_dir,
            every_steps=every_steps,
            keep=keep,
            max_workers=max_workers or world_size,
            attempt=attempt,
            resume_path=resume_path,
        )
        return cls(rank, world_size, config, None, device or torch.device("cpu"))

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        """Tell the supervisor (fire and forget: training never waits on it). Safe from
        the checkpoint writer's thread."""
        if self.outbox is not None:
            self.outbox.record(kind, {"attempt": self.attempt, **data})
        else:
            self.local_events.append((kind, {"attempt": self.attempt, **data}))
        if self.tensorboard is not None:
            self.tensorboard.record(kind, data)
        if self.mlflow is not None:
            self.mlflow.record(kind, data)

    def close(self) -> None:
        """Flush what the worker writes besides checkpoints (its TensorBoard files, its
        MLflow points). Called in a ``finally``: an exception being handled fails the run."""
        self._closed.set()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.mlflow is not None:
            self.mlflow.close()

    def should_pause(self, step: int) -> bool:
        """Rank 0, at a checkpoint: does the supervisor want to restart bigger from here?
        Asked as soon as the state is copied, not after it is written."""
        if self.supervisor is None:
            return False
        import ray

        return bool(ray.get(self.supervisor.should_pause.remote(self.attempt, step), timeout=30))

    def watch_for_drain(self, every_s: float = DRAIN_POLL_S) -> None:
        """Rank 0: ask the supervisor in the background whether a node of this attempt is
        draining, so that the loop reads the answer at each step without waiting on it."""
        supervisor = self.supervisor
        if supervisor is None:
            return
        import ray

        def poll() -> None:
            while not self._closed.wait(every_s):
                try:
                    pending = ray.get(supervisor.drain_pending.remote(self.attempt), timeout=10)
                except Exception as e:  # a busy or lost supervisor: ask again
                    log.debug("asking about a drain: %s", e)
                    continue
                if pending:
                    self._drain_noticed.set()
                    return

        threading.Thread(target=poll, name="etrain-drain-watch", daemon=True).start()

    def drain_noticed(self) -> bool:
        """Whether the supervisor said a node of this attempt is draining (rank 0 only)."""
        return self._drain_noticed.is_set()
