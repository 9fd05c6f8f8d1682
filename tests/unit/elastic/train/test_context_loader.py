"""``ctx.batches`` with DataLoader worker processes: the samples, their order, their random
augmentations (``PerSampleRandom``) and so the float64 model are those of ``num_workers=0``,
across epochs (prefetching reads ahead into the next one) and across a resume from a
checkpoint. One standalone worker on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from elastic.train.context import PerSampleRandom, TrainContext, run_with_context
from elastic.train.step_loader import LoaderOptions
from elastic.train.worker import WorkerContext

ROWS, BATCH, STEPS, EVERY = 40, 8, 12, 6  # 5 steps an epoch: the run spans 3 epochs


class Jittered(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each read adds noise drawn from torch's generator: an augmentation."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(6)
        self.x = torch.randn(ROWS, 4, generator=g, dtype=torch.float64)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(4, dtype=torch.float64), self.y[i]


def train(root: Path, resume: Path | None = None, **loading: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {"indices": {}, "inputs": {}}

    def loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(1)
        model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
        ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        data = PerSampleRandom(Jittered(), seed=9)
        for batch in ctx.batches(data, BATCH, max_steps=STEPS, seed=2, **loading):
            seen["indices"][batch.step] = list(batch.indices)
            seen["inputs"][batch.step] = batch.inputs.clone()
            ctx.train_step(batch, lambda out, y: ((out - y) ** 2).sum(dim=1))
        seen["params"] = [p.detach().clone() for p in model.parameters()]

    worker = WorkerContext.standalone(
        0, 1, str(root), every_steps=EVERY, resume_path=None if resume is None else str(resume)
    )
    run_with_context(loop, {}, worker)
    return seen


def test_worker_processes_load_the_same_samples_the_same_way(tmp_path: Path) -> None:
    alone = train(tmp_path / "main")
    workers = train(tmp_path / "workers", num_workers=2, prefetch_factor=3)
    assert sorted(alone["indices"]) == list(range(1, STEPS + 1))
    assert workers["indices"] == alone["indices"]
    for step, inputs in alone["inputs"].items():
        assert torch.equal(workers["inputs"][step], inputs), step
    assert all(torch.equal(a, b) for a, b in zip(workers["params"], alone["params"], strict=True))
    # The augmentations differ from epoch to epoch: the epoch reached each item.
    first = {i: row for i, row in zip(alone["indices"][1], alone["inputs"][1], strict=True)}
    later = {i: row for i, row in zip(alone["indices"][6], alone["inputs"][6], strict=True)}
    shared = first.keys() & later.keys()
    assert shared and all(not torch.equal(first[i], later[i]) for i in shared)


def test_a_run_resumed_with_worker_processes_ends_where_one_without_ends(tmp_path: Path) -> None:
    alone = train(tmp_path / "main")
    resumed = train(
        tmp_path / "resumed",
        resume=tmp_path / "main" / f"step_{EVERY:010d}",
        num_workers=2,
        persistent_workers=True,
    )
    assert sorted(resumed["indices"]) == list(range(EVERY + 1, STEPS + 1))
    for step in range(EVERY + 1, STEPS + 1):
        assert resumed["indices"][step] == alone["indices"][step]
        assert torch.equal(resumed["inputs"][step], alone["inputs"][step]), step
    assert all(torch.equal(a, b) for a, b in zip(resumed["params"], alone["params"], strict=True))


def test_loader_settings_that_need_workers_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="need num_workers > 0"):
        LoaderOptions(num_workers=0, persistent_workers=True)
    assert LoaderOptions(num_workers=2, prefetch_factor=4).loader_kwargs(torch.device("cpu")) == {
        "num_workers": 2,
        "pin_memory": False,
        "persistent_workers": False,
        "prefetch_factor": 4,
    }
