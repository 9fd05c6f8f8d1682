"""The supervised training loop every built-in workload runs inside a Ray Train worker.

A workload supplies its model, dataset and loss; this loop supplies what makes the job
elastic and restartable: the resize-invariant data order, the global-batch arithmetic,
checkpoints at fixed step boundaries, restore, and metrics for the supervisor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from elastic.sampling import SamplerPosition, advance, rank_indices, steps_per_epoch
from elastic.worker import WorkerContext, position_from_dict, position_to_dict


@dataclass
class LoopSettings:
    global_batch_size: int
    seed: int
    max_steps: int | None
    epochs: int | None
    report_every_steps: int


@dataclass
class TrainingParts:
    model: nn.Module
    dataset: Dataset
    make_optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
    # Per-sample losses, so the loop can weight them to the exact global-batch mean.
    loss_per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def total_steps(settings: LoopSettings, dataset_size: int) -> int:
    limits = []
    if settings.max_steps is not None:
        limits.append(settings.max_steps)
    if settings.epochs is not None:
        limits.append(settings.epochs * steps_per_epoch(dataset_size, settings.global_batch_size))
    return min(limits)


class _StepBatches(torch.utils.data.Sampler[list[int]]):
    """Feeds the DataLoader this rank's indices for each optimizer step from a position."""

    def __init__(self, position: SamplerPosition, dataset_size: int, settings: LoopSettings,
                 world_size: int, rank: int) -> None:
        self.position = position
        self.dataset_size = dataset_size
        self.settings = settings
        self.world_size = world_size
        self.rank = rank
        self.plan: list[tuple[SamplerPosition, int]] = []  # (position, global batch) per step

    def __iter__(self):
        for position, indices, batch in rank_indices(
            self.position, self.dataset_size, self.settings.global_batch_size,
            self.settings.seed, self.world_size, self.rank,
        ):
            self.plan.append((position, batch))
            yield indices


def run(config: dict[str, Any], settings: LoopSettings, parts: TrainingParts) -> None:
    ctx = WorkerContext.from_config(config)
    model = parts.model
    optimizer = parts.make_optimizer(list(model.parameters()))
    step = 0
    position = SamplerPosition()
    restored = ctx.restore()
    if restored is not None:
        model.load_state_dict(restored["model"])
        optimizer.load_state_dict(restored["optimizer"])
        step = int(restored["step"])
        position = position_from_dict(restored["sampler"])
        if ctx.rank == 0:
            ctx.emit("checkpoint_restored", {"step": step})
    model = ray.train.torch.prepare_model(model)
    device = ray.train.torch.get_device()

    dataset_size = len(parts.dataset)  # type: ignore[arg-type]
    last_step = total_steps(settings, dataset_size)
    batches = _StepBatches(position, dataset_size, settings, ctx.world_size, ctx.rank)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(parts.dataset, batch_sampler=batches, num_workers=0),
        add_dist_sampler=False,
    )
    first_step = step + 1
    window_start, window_samples = time.perf_counter(), 0
    batch_iter = iter(loader)
    while step < last_step:
        inputs, targets = next(batch_iter)
        position, global_batch = batches.plan.pop(0)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        if len(targets):
            outputs = model(inputs)
            losses = parts.loss_per_sample(outputs, targets)
            # DDP averages gradients over ranks; scaling by world/global makes the result
            # the mean over the global batch whatever the world size and however it splits.
            loss = losses.sum() * (ctx.world_size / global_batch)
            correct = (outputs.argmax(dim=1) == targets).sum()
            loss_sum = losses.detach().sum()
        else:  # a short last batch left this rank nothing: join the all-reduce with zeros
            loss = sum(p.sum() * 0.0 for p in model.parameters())  # type: ignore[assignment]
            correct = torch.zeros((), device=device)
            loss_sum = torch.zeros((), device=device)
        loss.backward()
        optimizer.step()
        step += 1
        position = advance(position, dataset_size, settings.global_batch_size)
        window_samples += global_batch

        if step in (first_step, last_step) or step % settings.report_every_steps == 0:
            totals = torch.stack([loss_sum.float(), correct.float()]).to(device)
            if ctx.world_size > 1:
                dist.all_reduce(totals)
            if ctx.rank == 0:
                elapsed = time.perf_counter() - window_start
                ctx.emit("metrics", {
                    "step": step,
                    "epoch": position.epoch if position.consumed else position.epoch - 1,
                    "loss": float(totals[0]) / global_batch,
                    "accuracy": float(totals[1]) / global_batch,
                    "samples_per_s": window_samples / elapsed if elapsed > 0 else None,
                    "learning_rate": optimizer.param_groups[0]["lr"],
                    "world_size": ctx.world_size,
                    "total_steps": last_step,
                })
            window_start, window_samples = time.perf_counter(), 0

        if ctx.rank == 0 and (step % ctx.every_steps == 0 or step == last_step):
            unwrapped: nn.Module = getattr(model, "module", model)
            ctx.save(step, {
                "model": unwrapped.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "sampler": position_to_dict(position),
            })
