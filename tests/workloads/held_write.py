"""The paced workload (tests/workloads/paced.py) with a checkpoint write held in flight: once
the ``write_arm`` file exists, the next checkpoint this process writes says so in the job's
log (with its step) and holds before its first byte until the ``write_release`` file
exists. A test preempts the job in that window, so the replica that must leave with a
checkpoint of its step has an earlier write still in flight."""

from __future__ import annotations

import os
import time
from typing import Any

from elastic.checkpoint.writer import CheckpointManager
from elastic.train.context import TrainContext
from tests.workloads import paced

HOLD_S = 120.0


def hold_next_write(arm: str, release: str) -> None:
    """In this worker's process: the first write after ``arm`` appears holds until
    ``release`` appears."""
    write = CheckpointManager._write
    if getattr(write, "held", False):
        return
    held_once: list[int] = []

    def held_write(self: CheckpointManager, step: int, *args: Any) -> None:
        if os.path.exists(arm) and not held_once:
            held_once.append(step)
            print(f"[held-write] writing the checkpoint of step {step}", flush=True)
            deadline = time.monotonic() + HOLD_S
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        write(self, step, *args)

    held_write.held = True  # type: ignore[attr-defined]
    CheckpointManager._write = held_write  # type: ignore[method-assign]


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hyperparameters = dict(config["hyperparameters"])
    hold_next_write(
        str(hyperparameters.pop("write_arm")), str(hyperparameters.pop("write_release"))
    )
    paced.train_loop({**config, "hyperparameters": hyperparameters}, ctx)
