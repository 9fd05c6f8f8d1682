"""The built-in image-classification workload, with a hold on the state a replica sends to
a healing joiner: once the ``heal_arm`` file exists, a replica asked for its state by
torchft's heal says so in the job's log (with its Ray node) and waits until the
``heal_release`` file exists. A test kills the sender's node in that window. While the
``pace`` file exists, each step waits ``PACE_S`` first, so that the job is still training
when a replica placed on a node added late has started (a process start on a loaded 2-core
machine takes seconds; unpaced, the job could end first)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import ray

from elastic.loop import TrainContext
from jobs.workloads import image_classification

HOLD_S = 120.0
PACE_S = 0.2


def _for_a_heal() -> bool:
    """Called from torchft's heal (the manager's state for a peer), not a checkpoint."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_manager_state_dict":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class HeldSend:
    def __init__(self, arm: str, release: str) -> None:
        self.arm, self.release = arm, release

    def state_dict(self) -> dict[str, Any]:
        if os.path.exists(self.arm) and not os.path.exists(self.release) and _for_a_heal():
            node = ray.get_runtime_context().get_node_id()
            print(f"[held-heal] sending state from node {node}", flush=True)
            deadline = time.monotonic() + HOLD_S
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.05)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PacedContext:
    """The job's context, with every batch held ``PACE_S`` while the pace file exists: time
    only, so the training (and its exactness) is unchanged."""

    def __init__(self, ctx: TrainContext, pace: str) -> None:
        self._ctx, self._pace = ctx, pace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def batches(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for batch in self._ctx.batches(*args, **kwargs):
            if os.path.exists(self._pace):
                time.sleep(PACE_S)
            yield batch


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hyperparameters = dict(config["hyperparameters"])
    held = HeldSend(str(hyperparameters.pop("heal_arm")), str(hyperparameters.pop("heal_release")))
    pace = str(hyperparameters.pop("pace"))
    ctx.checkpoints.state.register("held_send", held)
    paced: Any = PacedContext(ctx, pace)
    image_classification.train_loop({**config, "hyperparameters": hyperparameters}, paced)
