"""A loop's own LR scheduler: given to ``ctx.prepare_scheduler``, it is stepped where the
loop steps it and saved with each checkpoint, so a resumed run goes on with the same rates;
not given, it is refused at the first ``ctx.batches``, naming the way out (the context
would set the rate at every step and override it without a word)."""

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


def step_lr_loop(epochs: int, seen: list[tuple[int, float]], params: list[torch.Tensor]) -> Any:
    """Four steps an epoch, StepLR stepped at each epoch's end, as the loop's own."""

    def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(0)
        model = ctx.prepare_model(nn.Linear(2, 1, dtype=torch.float64))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.7))
        scheduler = ctx.prepare_scheduler(
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        )
        g = torch.Generator().manual_seed(1)
        x = torch.randn(16, 2, generator=g, dtype=torch.float64)
        data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.3)
        for batch in ctx.batches(data, global_batch_size=4, epochs=epochs):
            ctx.train_step(batch, lambda out, y: ((out - y) ** 2).sum(dim=1))
            seen.append((batch.step, optimizer.param_groups[0]["lr"]))
            if batch.ends_epoch:
                scheduler.step()
        params[:] = [p.detach().clone() for p in model.parameters()]

    return train_loop


def test_a_scheduler_given_to_the_context_keeps_its_rates_across_a_resume(
    tmp_path: Path,
) -> None:
    whole: list[tuple[int, float]] = []
    whole_params: list[torch.Tensor] = []
    worker = WorkerContext.standalone(0, 1, str(tmp_path / "whole"), every_steps=100)
    run_with_context(step_lr_loop(3, whole, whole_params), {}, worker)
    assert [round(lr, 12) for _, lr in whole] == [0.7] * 4 + [0.49] * 4 + [0.343] * 4
    rates = {d["step"]: d["learning_rate"] for k, d in worker.local_events if k == "metrics"}
    assert round(rates[5], 12) == 0.49

    # Stopped after step 6 (checkpoint every 3 steps), then resumed from step 6.
    first: list[tuple[int, float]] = []
    root = str(tmp_path / "resumed")
    worker = WorkerContext.standalone(0, 1, root, every_steps=3)
    halted = step_lr_loop(3, first, [])

    def until_six(config: dict[str, Any], ctx: TrainContext) -> None:
        ctx.batches = _stop_after(ctx.batches, 6)  # type: ignore[method-assign]
        halted(config, ctx)

    run_with_context(until_six, {}, worker)
    saved = [d["path"] for k, d in worker.local_events if k == "checkpoint_saved"]
    rest: list[tuple[int, float]] = []
    rest_params: list[torch.Tensor] = []
    resumed = WorkerContext.standalone(0, 1, root, every_steps=3, resume_path=saved[-1])
    run_with_context(step_lr_loop(3, rest, rest_params), {}, resumed)
    assert first + rest == whole
    for a, b in zip(whole_params, rest_params, strict=True):
        assert torch.equal(a, b)


def _stop_after(batches: Any, last: int) -> Any:
    def limited(*args: Any, **kwargs: Any) -> Any:
        for batch in batches(*args, **kwargs):
            yield batch
            if batch.step == last:
                return

    return limited


def test_a_scheduler_given_to_the_context_with_its_own_schedule_is_refused(
    tmp_path: Path,
) -> None:
    def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
        model = ctx.prepare_model(nn.Linear(2, 1))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.7))
        ctx.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
        data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
        for _ in ctx.batches(data, global_batch_size=4, epochs=1, lr_schedule="cosine"):
            pass

    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    with pytest.raises(ValueError, match=r"leave ctx\.batches' lr_schedule 'constant'"):
        run_with_context(train_loop, {}, worker)
