"""What a training worker knows about its job: rank, world, where to checkpoint, whom to tell."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import torch

from elastic.checkpoints import CheckpointDir, CheckpointInfo
from elastic.sampling import SamplerPosition

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"


@dataclass
class WorkerContext:
    """Built from the ``_elastic`` part of the train-loop config that the supervisor passes."""

    rank: int
    world_size: int
    attempt: int
    checkpoints: CheckpointDir
    every_steps: int
    keep: int
    supervisor: Any  # the supervisor's actor handle, or None when run without one
    resume_path: str | None  # the verified checkpoint this attempt starts from
    max_workers: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Without a supervisor (a worker started by hand, a test), events are kept here.
    local_events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WorkerContext:
        import ray.train.torch

        meta = config["_elastic"]
        ctx = ray.train.get_context()
        supervisor = None
        if meta.get("supervisor"):
            supervisor = ray.get_actor(meta["supervisor"], namespace=meta["namespace"])
        worker = cls(
            rank=ctx.get_world_rank(),
            world_size=ctx.get_world_size(),
            attempt=int(meta["attempt"]),
            checkpoints=CheckpointDir(meta["checkpoint_dir"]),
            every_steps=int(meta["every_steps"]),
            keep=int(meta["keep"]),
            supervisor=supervisor,
            resume_path=meta.get("resume_path"),
            max_workers=int(meta["max_workers"]),
            device=ray.train.torch.get_device(),
        )
        if supervisor is not None:
            supervisor.register_worker.remote(
                int(meta["attempt"]), ctx.get_world_rank(), ray.get_runtime_context().get_node_id()
            )
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
        return cls(
            rank=rank,
            world_size=world_size,
            attempt=attempt,
            checkpoints=CheckpointDir(checkpoint_dir),
            every_steps=every_steps,
            keep=keep,
            supervisor=None,
            resume_path=resume_path,
            max_workers=max_workers or world_size,
            device=device or torch.device("cpu"),
        )

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        """Tell the supervisor (fire and forget: training never waits on it)."""
        if self.supervisor is not None:
            self.supervisor.record.remote(kind, {"attempt": self.attempt, **data})
        else:
            self.local_events.append((kind, {"attempt": self.attempt, **data}))

    def should_pause(self, step: int) -> bool:
        """Rank 0, after a checkpoint: does the supervisor want to restart bigger from here?"""
        if self.supervisor is None:
            return False
        return bool(ray.get(self.supervisor.should_pause.remote(self.attempt, step), timeout=30))

    # -- checkpoints -------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> CheckpointInfo:
        state = {**state, "rng": _rng_state()}
        info = self.checkpoints.save(step, lambda d: torch.save(state, d / STATE_FILE))
        self.emit(
            "checkpoint_saved",
            {
                "step": step,
                "path": info.path,
                "size_bytes": info.size_bytes,
                "created_at": info.created_at,
            },
        )
        pruned = self.checkpoints.prune(self.keep, protect=step)
        for bad, why, _ in pruned.set_aside:
            self.emit("checkpoint_corrupt", {"step": bad.step, "path": bad.path, "reason": why})
        for removed in pruned.removed:
            self.emit("checkpoint_removed", {"step": removed.step, "path": removed.path})
        return info

    def restore(self, set_rng: bool = True) -> dict[str, Any] | None:
        """The state of the checkpoint this attempt starts from, if any (and, unless told
        otherwise, the random generators as they were when it was saved)."""
        if not self.resume_path:
            return None
        # The supervisor verified it when it chose it; storage may have changed since.
        self.checkpoints.verify(self.resume_path)
        state = torch.load(
            Path(self.resume_path) / STATE_FILE, map_location="cpu", weights_only=False
        )
        if set_rng:
            set_rng_state(state.get("rng"))
        return state


def position_to_dict(position: SamplerPosition) -> dict[str, int]:
    return {"epoch": position.epoch, "consumed": position.consumed}


def position_from_dict(data: dict[str, int] | None) -> SamplerPosition:
    return SamplerPosition(**data) if data else SamplerPosition()


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any] | None) -> None:
    if not state:
        return
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
