"""A loop written the way people write one, an epoch function called per epoch that returns
at the epoch's end, leaves ``ctx.batches`` suspended right after the run's last step: that
step's count, report and the run's final checkpoint still happen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.train.context import StepBatch, TrainContext, run_with_context
from elastic.train.worker import WorkerContext

ROWS, BATCH, EPOCHS = 24, 8, 2  # 3 steps an epoch


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum(dim=1)


def run(tmp_path: Path, leave_at_epoch_end: bool, stop_after: int | None = None) -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    data = TensorDataset(x, x[:, :1] * 0.5)
    seen: dict[str, Any] = {}

    def epoch(ctx: TrainContext, steps: Any) -> None:
        batch: StepBatch
        for batch in steps:
            ctx.train_step(batch, squared_error)
            if stop_after is not None and batch.step == stop_after:
                return
            if leave_at_epoch_end and batch.ends_epoch:
                return

    def loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(0)
        model = ctx.prepare_model(nn.Linear(3, 1, dtype=torch.float64))
        ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        steps = ctx.batches(data, BATCH, epochs=EPOCHS, seed=3)
        for _ in range(EPOCHS if stop_after is None else 1):
            epoch(ctx, steps)
        seen["model"] = [p.detach().clone() for p in model.parameters()]

    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    run_with_context(loop, {}, worker)
    metrics = [d["step"] for k, d in worker.local_events if k == "metrics"]
    saved = [d["step"] for k, d in worker.local_events if k == "checkpoint_saved"]
    return metrics, saved, worker.completed_step, seen["model"]


def test_an_epoch_function_that_returns_at_the_end_loses_no_step(tmp_path: Path) -> None:
    whole = run(tmp_path / "whole", leave_at_epoch_end=False)
    per_epoch = run(tmp_path / "per-epoch", leave_at_epoch_end=True)
    assert whole[:3] == per_epoch[:3] == ([1, 2, 3, 4, 5, 6], [6], 6)
    for a, b in zip(whole[3], per_epoch[3], strict=True):
        assert torch.equal(a, b)


def test_a_loop_that_stops_early_counts_its_last_trained_step_and_takes_no_other(
    tmp_path: Path,
) -> None:
    metrics, saved, completed, _ = run(tmp_path, leave_at_epoch_end=False, stop_after=2)
    assert (metrics, saved, completed) == ([1, 2], [], 2)
