"""The training loop's side of a drain, in one process and milliseconds: once rank 0 has
heard of a drain, the loop checkpoints the step of its next report (off the
``every_steps`` schedule), publishes it, and ends the attempt there when the supervisor
says pause.

The supervisor is the one part played here (its answers: a drain is pending once a given
step is done; pause now); the loop, its checkpoints and its reports are the real ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic.train.context import run_with_context
from elastic.train.worker import WorkerContext
from examples.custom_train_loop import train_loop

DRAIN_AT = 7


class DrainedWorker(WorkerContext):
    """A standalone worker whose supervisor reports a drain once step DRAIN_AT is done,
    and answers every pause question after that with yes."""

    asked: list[int]

    def drain_noticed(self) -> bool:
        return self.completed_step >= DRAIN_AT

    def should_pause(self, step: int) -> bool:
        self.asked.append(step)
        return self.drain_noticed()


def config(report_every_steps: int) -> dict[str, Any]:
    return {
        "hyperparameters": {
            "seed": 0,
            "global_batch_size": 64,
            "epochs": 4,
            "report_every_steps": report_every_steps,
        }
    }


@pytest.mark.parametrize(("report_every_steps", "paused_at"), [(1, DRAIN_AT), (8, 8)])
def test_a_drain_checkpoints_and_pauses_at_the_next_reported_step(
    tmp_path: Path, report_every_steps: int, paused_at: int
) -> None:
    standalone = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    worker = DrainedWorker(0, 1, standalone.config, None)
    worker.asked = []
    run_with_context(train_loop, config(report_every_steps), worker)

    saved = [d["step"] for k, d in worker.local_events if k == "checkpoint_saved"]
    reported = [d["step"] for k, d in worker.local_events if k == "metrics"]
    # Checkpoints are due every 100 steps: the one taken is the drain's, at the first
    # report after step 7 (the flag rides on the report), and training stops there.
    assert saved == [paused_at]
    assert max(reported) == paused_at and worker.completed_step == paused_at
    assert worker.asked == [paused_at]
    assert (tmp_path / f"step_{paused_at:010d}").is_dir()


def test_without_a_drain_the_schedule_alone_decides(tmp_path: Path) -> None:
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    run_with_context(train_loop, config(1), worker)
    saved = [d["step"] for k, d in worker.local_events if k == "checkpoint_saved"]
    # 4 epochs of 4096 samples at 64 a step: 256 steps, checkpoints at 100, 200 and the end.
    assert saved == [100, 200, 256]
