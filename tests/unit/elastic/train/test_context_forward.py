"""A loop's own forward pass through ``ctx.train_step(batch, forward=fn)``: the context still
picks the samples, cuts micro-batches and weights each loss to the global batch's mean, so
the step is the one ``train_step(batch, loss_per_sample)`` takes; dict batches and models
returning objects train; ``before_step`` sees the final gradients; the returned loss is the
global mean. One standalone worker on the CPU, float64, micro-batches of 4 (max_workers 3
for a global batch of 12: three passes accumulated per step)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from elastic.train.context import MicroBatch, StepBatch, TrainContext, run_with_context
from elastic.train.distributed import unwrap
from elastic.train.worker import WorkerContext

ROWS, BATCH, STEPS, LR = 48, 12, 6, 0.1


def table() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(ROWS, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, x[:, :1] * 0.7 - x[:, 1:2] * 0.3)


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum(dim=1)


Step = Callable[[TrainContext, nn.Module, StepBatch], Any]


def run(tmp_path: Path, step: Step, dataset: Dataset[Any] | None = None) -> dict[str, Any]:
    """Trains STEPS steps of ``step(ctx, model, batch)``; what it returned at each step,
    the parameters after each, the reported losses."""
    facts: dict[str, Any] = {"returned": [], "params": []}

    def loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(2)
        model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
        ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        for batch in ctx.batches(dataset or table(), BATCH, max_steps=STEPS, seed=5):
            facts["returned"].append(step(ctx, model, batch))
            facts["params"].append([p.detach().clone() for p in model.parameters()])

    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100, max_workers=3)
    run_with_context(loop, {}, worker)
    facts["reported"] = [d["loss"] for k, d in worker.local_events if k == "metrics"]
    facts["accuracy"] = [d["accuracy"] for k, d in worker.local_events if k == "metrics"]
    return facts


def test_the_loop_s_own_forward_takes_the_step_the_context_s_takes_bit_for_bit(
    tmp_path: Path,
) -> None:
    passes: list[tuple[int, bool]] = []

    def context_s(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        return ctx.train_step(batch, squared_error)

    def own(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        def forward(micro: MicroBatch) -> torch.Tensor:
            passes.append((micro.rows, micro.padding))
            return squared_error(model(micro.inputs), micro.targets)

        return ctx.train_step(batch, forward=forward)

    before = run(tmp_path / "before", context_s)
    after = run(tmp_path / "after", own)
    assert passes == [(4, False)] * 3 * STEPS
    for a, b in zip(before["params"], after["params"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert after["returned"] == before["returned"] == before["reported"] == after["reported"]
    # Accuracy needs the outputs, which only the context's own forward pass sees.
    assert after["accuracy"] == [None] * STEPS


def test_the_returned_loss_is_the_mean_over_the_global_batch(tmp_path: Path) -> None:
    data = table()
    by_hand: list[float] = []

    def step(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        x, y = data.tensors[0][batch.indices], data.tensors[1][batch.indices]
        with torch.no_grad():
            by_hand.append(float(squared_error(model(x), y).mean()))
        return ctx.train_step(batch, forward=lambda m: squared_error(model(m.inputs), m.targets))

    facts = run(tmp_path, step)
    assert len(by_hand) == STEPS
    assert facts["returned"] == pytest.approx(by_hand, rel=1e-13, abs=0)
    assert facts["reported"] == facts["returned"]


@dataclass
class Output:
    logits: torch.Tensor


class Classifier(nn.Module):
    """Keyword inputs and an object out, as a Hugging Face model takes and gives."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Output:
        return Output(logits=self.head(input_ids * attention_mask))


class Encoded(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(8)
        self.ids = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
        self.mask = (torch.rand(ROWS, 6, generator=g) > 0.2).to(torch.float64)
        self.labels = torch.randint(0, 3, (ROWS,), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def test_a_dict_batch_and_a_model_returning_an_object_train_exactly(tmp_path: Path) -> None:
    """Each micro-batch is the dict's rows; the first step is plain SGD on the global
    batch's mean loss, computed by hand from the same rows."""
    data = Encoded()
    seen: list[MicroBatch] = []
    expected: dict[str, Any] = {}

    def loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(3)
        model = ctx.prepare_model(Classifier())
        ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=LR))

        def forward(micro: MicroBatch) -> torch.Tensor:
            seen.append(micro)
            inputs = micro.inputs
            out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            return F.cross_entropy(out.logits, inputs["labels"], reduction="none")

        for batch in ctx.batches(data, BATCH, max_steps=2, seed=5):
            if batch.step == 1:
                reference = copy.deepcopy(unwrap(model))
                rows = data[batch.indices]  # a dict of the step's rows, in its order
                loss = F.cross_entropy(
                    reference(rows["input_ids"], rows["attention_mask"]).logits,
                    rows["labels"],
                )
                loss.backward()
                expected["loss"] = float(loss.detach())
                expected["params"] = [p.detach() - LR * p.grad for p in reference.parameters()]
            returned = ctx.train_step(batch, forward=forward)
            if batch.step == 1:
                expected["returned"] = returned
                expected["trained"] = [p.detach().clone() for p in model.parameters()]

    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=100, max_workers=3)
    run_with_context(loop, {}, worker)
    assert [m.rows for m in seen] == [4] * 6
    assert all(m.targets is None and set(m.inputs) == set(data[0]) for m in seen)
    assert expected["returned"] == pytest.approx(expected["loss"], rel=1e-13, abs=0)
    for got, want in zip(expected["trained"], expected["params"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_before_step_sees_the_global_mean_gradient_and_its_clipping_is_what_is_stepped(
    tmp_path: Path,
) -> None:
    data = table()
    norms: dict[str, list[float]] = {"by_hand": [], "seen": [], "clipped": []}
    moved: list[bool] = []
    expected: list[torch.Tensor] = []
    max_norm = 1e-3

    def step(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        reference = copy.deepcopy(unwrap(model))
        x, y = data.tensors[0][batch.indices], data.tensors[1][batch.indices]
        squared_error(reference(x), y).mean().backward()
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        norms["by_hand"].append(
            float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
        )
        start = [p.detach().clone() for p in model.parameters()]

        def clip() -> None:
            norms["seen"].append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            norms["clipped"].append(float(torch.linalg.vector_norm(flat)))
            # The first step's momentum buffer is the gradient: it moves each parameter by
            # exactly lr times the clipped gradient.
            expected[:] = [s - LR * p.grad for s, p in zip(start, model.parameters(), strict=True)]

        ctx.train_step(
            batch, forward=lambda m: squared_error(model(m.inputs), m.targets), before_step=clip
        )
        if batch.step == 1:
            after = [p.detach() for p in model.parameters()]
            moved.append(all(torch.equal(a, e) for a, e in zip(after, expected, strict=True)))

    run(tmp_path, step)
    assert len(norms["seen"]) == STEPS
    assert norms["seen"] == pytest.approx(norms["by_hand"], rel=1e-12, abs=0)
    assert all(n > max_norm for n in norms["seen"])
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6).
    clipped = [max_norm * n / (n + 1e-6) for n in norms["seen"]]
    assert norms["clipped"] == pytest.approx(clipped, rel=1e-12, abs=0)
    assert moved == [True]


def test_a_forward_returning_a_mean_is_refused_not_weighted_as_a_sample(tmp_path: Path) -> None:
    def step(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        return ctx.train_step(
            batch, forward=lambda m: squared_error(model(m.inputs), m.targets).mean()
        )

    with pytest.raises(
        ValueError, match=r"one loss per sample, a tensor of shape \(4,\), not \(\)"
    ):
        run(tmp_path, step)


def test_train_step_takes_one_forward_pass(tmp_path: Path) -> None:
    def both(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        return ctx.train_step(batch, squared_error, forward=lambda m: model(m.inputs))

    with pytest.raises(TypeError, match="either loss_per_sample or forward="):
        run(tmp_path, both)


def test_a_dict_batch_needs_the_loop_s_forward(tmp_path: Path) -> None:
    def context_s(ctx: TrainContext, model: nn.Module, batch: StepBatch) -> Any:
        return ctx.train_step(batch, squared_error)

    with pytest.raises(ValueError, match="not \\(inputs, targets\\) pairs"):
        run(tmp_path, context_s, Encoded())
