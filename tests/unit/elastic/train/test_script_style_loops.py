"""A loop written as a script is: ``def main():`` reading its flags with argparse, an epoch
function with ``for batch in loader:``, and the model, optimizer and scheduler built as
always, then given to the context in one ``ctx.prepare`` call. It trains exactly as the
same steps taken through ``ctx.batches``, and resumes mid-epoch where it stopped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.train import get_context
from elastic.train.context import TrainContext, run_with_context
from elastic.train.current import arity_problem, call_train_loop
from elastic.train.worker import WorkerContext

ROWS, BATCH, EPOCHS = 24, 8, 3  # 3 steps an epoch


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, x[:, :1] * 0.5)


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum(dim=1)


def script(seen: dict[str, Any], stop_after: int | None = None) -> Any:
    """A script's ``main()``: its flags from ``sys.argv``, its context from get_context."""

    def main() -> None:
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=1.0)
        parser.add_argument("--gamma", type=float, default=1.0)
        args = parser.parse_args()
        ctx = get_context()
        torch.manual_seed(0)
        model = nn.Linear(3, 1, dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=args.gamma)
        model, optimizer, scheduler = ctx.prepare(model, optimizer, scheduler)
        loader = ctx.loader(data(), BATCH, epochs=EPOCHS, seed=3)
        for epoch in range(ctx.position.epoch, EPOCHS):
            steps = seen.setdefault("epochs", {}).setdefault(epoch, [])
            for batch in loader:
                steps.append(batch.step)
                ctx.train_step(batch, squared_error)
                if batch.step == stop_after:
                    return
            scheduler.step()
        seen["model"] = [p.detach().clone() for p in model.parameters()]
        seen["lr"] = optimizer.param_groups[0]["lr"]

    return main


def flat(seen: dict[str, Any]) -> Any:
    """The same training through ``ctx.batches`` and the separate prepare calls."""

    def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(0)
        model = ctx.prepare_model(nn.Linear(3, 1, dtype=torch.float64))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        scheduler = ctx.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
        for batch in ctx.batches(data(), BATCH, epochs=EPOCHS, seed=3):
            ctx.train_step(batch, squared_error)
            if batch.ends_epoch:
                scheduler.step()
        seen["model"] = [p.detach().clone() for p in model.parameters()]
        seen["lr"] = optimizer.param_groups[0]["lr"]

    return train_loop


ARGS = {"hyperparameters": {"args": ["--lr", "0.1", "--gamma", "0.5"]}}


def events(worker: WorkerContext, kind: str, key: str) -> list[Any]:
    return [d[key] for k, d in worker.local_events if k == kind]


def test_a_script_style_loop_trains_each_epoch_as_ctx_batches_does(tmp_path: Path) -> None:
    argv = list(sys.argv)
    seen: dict[str, Any] = {}
    worker = WorkerContext.standalone(0, 1, str(tmp_path / "script"), every_steps=100)
    run_with_context(script(seen), ARGS, worker)
    assert sys.argv == argv  # the process's own, back
    assert seen["epochs"] == {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9]}
    assert seen["lr"] == 0.1 * 0.5**3

    reference: dict[str, Any] = {}
    other = WorkerContext.standalone(0, 1, str(tmp_path / "flat"), every_steps=100)
    run_with_context(flat(reference), {}, other)
    for a, b in zip(seen["model"], reference["model"], strict=True):
        assert torch.equal(a, b)
    assert events(worker, "metrics", "step") == events(other, "metrics", "step")
    assert events(worker, "checkpoint_saved", "step") == [9]


def test_a_script_style_loop_resumes_in_the_middle_of_its_epoch(tmp_path: Path) -> None:
    whole: dict[str, Any] = {}
    run_with_context(
        script(whole), ARGS, WorkerContext.standalone(0, 1, str(tmp_path / "w"), every_steps=100)
    )
    root = str(tmp_path / "stopped")
    first: dict[str, Any] = {}
    stopped = WorkerContext.standalone(0, 1, root, every_steps=5)
    run_with_context(script(first, stop_after=5), ARGS, stopped)
    assert first["epochs"] == {0: [1, 2, 3], 1: [4, 5]}
    saved = events(stopped, "checkpoint_saved", "path")
    assert events(stopped, "checkpoint_saved", "step") == [5]

    rest: dict[str, Any] = {}
    resumed = WorkerContext.standalone(0, 1, root, every_steps=5, resume_path=saved[-1])
    run_with_context(script(rest), ARGS, resumed)
    assert rest["epochs"] == {1: [6], 2: [7, 8, 9]}  # the rest of epoch 1 first
    assert rest["lr"] == whole["lr"]
    for a, b in zip(rest["model"], whole["model"], strict=True):
        assert torch.equal(a, b)


def test_prepare_refuses_an_optimizer_built_on_another_model(tmp_path: Path) -> None:
    def main() -> None:
        ctx = get_context()
        other = nn.Linear(3, 1)
        ctx.prepare(nn.Linear(3, 1), torch.optim.SGD(other.parameters(), lr=0.1))

    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100)
    with pytest.raises(ValueError, match="built on the model's parameters"):
        run_with_context(main, {}, worker)


def test_a_loop_is_called_as_it_is_written_and_the_context_is_only_its_own() -> None:
    with pytest.raises(RuntimeError, match="no training context in this process"):
        get_context()

    def one(ctx: Any) -> None: ...

    def three(a: Any, b: Any, c: Any) -> None: ...

    def defaults(config: Any = None) -> None: ...

    def pair(config: Any, ctx: Any) -> None: ...

    assert arity_problem(one) == (
        "one must take no arguments or (config, ctx), not 1: it takes either no arguments "
        "(see elastic.train.get_context) or (config, ctx)"
    )
    assert arity_problem(three) is not None
    assert arity_problem(defaults) is arity_problem(pair) is None
    with pytest.raises(TypeError, match="not 1"):
        call_train_loop(one, {}, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"hyperparameters\.args must be a list of strings"):
        call_train_loop(defaults, {"hyperparameters": {"args": "--lr 1"}}, object())  # type: ignore[arg-type]
