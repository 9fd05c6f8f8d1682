"""A loop's own LR scheduler is refused at the first ``ctx.batches``, naming the way out:
the context sets the rate at every step, and would override it without a word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic.train.context import TrainContext, run_with_context
from elastic.train.worker import WorkerContext


def loop(with_scheduler: bool, seen: list[float]) -> Any:
    def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(0)
        model = ctx.prepare_model(nn.Linear(2, 1))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.7))
        if with_scheduler:
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        data = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
        for batch in ctx.batches(data, global_batch_size=4, epochs=1):
            ctx.train_step(batch, lambda out, y: ((out - y) ** 2).sum(dim=1))
            seen.append(optimizer.param_groups[0]["lr"])

    return train_loop


def test_a_loops_own_scheduler_is_refused_before_any_step(tmp_path: Path) -> None:
    seen: list[float] = []
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    with pytest.raises(ValueError, match="an LR scheduler of the loop's own is on this optimizer"):
        run_with_context(loop(True, seen), {}, worker)
    assert seen == []


def test_without_one_the_context_s_schedule_runs(tmp_path: Path) -> None:
    seen: list[float] = []
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    run_with_context(loop(False, seen), {}, worker)
    assert seen == [0.7] * 4
