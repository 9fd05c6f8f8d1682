"""The supervised training loop every built-in workload runs inside a Ray Train worker.

A workload supplies its model, dataset and loss; this loop supplies what makes the job
elastic and the training the same whatever the world size: the resumable data order, the
global batch kept whole by gradient accumulation, checkpoints at fixed step boundaries,
restore, pausing at a checkpoint so the supervisor can grow the job, and metrics.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from elastic.sampling import SamplerPosition, advance, rank_indices, steps_per_epoch
from elastic.schedule import lr_factor
from elastic.worker import WorkerContext, position_from_dict, position_to_dict


@dataclass
class LoopSettings:
    global_batch_size: int
    seed: int
    max_steps: int | None
    epochs: int | None
    report_every_steps: int
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    dtype: torch.dtype = torch.float32
    # Write the indices each rank trains on, per step, under the checkpoint dir (audits).
    record_samples: bool = False


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


def micro_batches(share: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """[start, end) slices of a rank's share, each at most ``micro_batch_size``."""
    return [(i, min(i + micro_batch_size, share)) for i in range(0, share, micro_batch_size)]


class _StepBatches(torch.utils.data.Sampler[list[int]]):
    """Feeds the DataLoader this rank's indices for each optimizer step from a position."""

    def __init__(self, position: SamplerPosition, dataset_size: int, settings: LoopSettings,
                 world_size: int, rank: int) -> None:
        self.position = position
        self.dataset_size = dataset_size
        self.settings = settings
        self.world_size = world_size
        self.rank = rank
        self.plan: list[tuple[SamplerPosition, list[int], int]] = []

    def __iter__(self):
        for position, indices, batch in rank_indices(
            self.position, self.dataset_size, self.settings.global_batch_size,
            self.settings.seed, self.world_size, self.rank,
        ):
            self.plan.append((position, indices, batch))
            yield indices


class _SampleLog:
    def __init__(self, ctx: WorkerContext, enabled: bool) -> None:
        self.file = None
        if enabled:
            folder = Path(ctx.checkpoints.root) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            self.file = (folder / f"attempt-{ctx.attempt}-rank-{ctx.rank}.jsonl").open("a")
            self.attempt = ctx.attempt

    def write(self, step: int, epoch: int, indices: list[int]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"a": self.attempt, "s": step, "e": epoch,
                                        "i": indices}) + "\n")
            self.file.flush()


def run(config: dict[str, Any], settings: LoopSettings, parts: TrainingParts) -> None:
    ctx = WorkerContext.from_config(config)
    model = parts.model.to(settings.dtype)
    optimizer = parts.make_optimizer(list(model.parameters()))
    dataset_size = len(parts.dataset)  # type: ignore[arg-type]
    last_step = total_steps(settings, dataset_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, last_step, settings.lr_schedule, settings.warmup_steps),
    )
    step = 0
    position = SamplerPosition()
    restored = ctx.restore()
    if restored is not None:
        model.load_state_dict(restored["model"])
        optimizer.load_state_dict(restored["optimizer"])
        scheduler.load_state_dict(restored["scheduler"])
        step = int(restored["step"])
        position = position_from_dict(restored["sampler"])
    model = ray.train.torch.prepare_model(model)
    device = ray.train.torch.get_device()
    # The micro-batch is a worker's share at full size: fewer workers accumulate more of
    # them, so memory per step stays put and one optimizer step still sees the global batch.
    micro = math.ceil(settings.global_batch_size / ctx.max_workers)

    batches = _StepBatches(position, dataset_size, settings, ctx.world_size, ctx.rank)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(parts.dataset, batch_sampler=batches, num_workers=0),
        add_dist_sampler=False,
    )
    samples = _SampleLog(ctx, settings.record_samples)
    first_step = step + 1
    window_start, window_samples = time.perf_counter(), 0
    batch_iter = iter(loader)
    model.train()
    while step < last_step:
        inputs, targets = next(batch_iter)
        position, indices, global_batch = batches.plan.pop(0)
        inputs = inputs.to(settings.dtype)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        correct = torch.zeros((), device=device, dtype=torch.float64)
        slices = micro_batches(len(targets), micro) or [(0, 0)]
        for n, (a, b) in enumerate(slices):
            # DDP all-reduces on the last micro-batch only; the others just accumulate.
            sync = n == len(slices) - 1
            no_sync = getattr(model, "no_sync", None)
            with contextlib.nullcontext() if sync or no_sync is None else no_sync():
                if b > a:
                    outputs = model(inputs[a:b])
                    losses = parts.loss_per_sample(outputs, targets[a:b])
                    # DDP averages over ranks; world/global makes the sum the exact mean over
                    # the global batch whatever the world size and however it is split.
                    loss = losses.sum() * (ctx.world_size / global_batch)
                    correct += (outputs.argmax(dim=1) == targets[a:b]).sum()
                    loss_sum += losses.detach().sum()
                else:  # a short last batch left this rank nothing: join with zeros
                    loss = sum(p.sum() * 0.0 for p in model.parameters())  # type: ignore[assignment]
                loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        samples.write(step, position.epoch, indices)
        position = advance(position, dataset_size, settings.global_batch_size)
        window_samples += global_batch

        if step in (first_step, last_step) or step % settings.report_every_steps == 0:
            totals = torch.stack([loss_sum, correct]).to(device)
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
                    "learning_rate": scheduler.get_last_lr()[0],
                    "world_size": ctx.world_size,
                    "total_steps": last_step,
                })
            window_start, window_samples = time.perf_counter(), 0

        if step % ctx.every_steps == 0 or step == last_step:
            pause = False
            if ctx.rank == 0:
                unwrapped: nn.Module = getattr(model, "module", model)
                ctx.save(step, {
                    "model": unwrapped.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "sampler": position_to_dict(position),
                })
                pause = step < last_step and ctx.should_pause(step)
            if ctx.world_size > 1 and step < last_step:
                flag = torch.tensor([1.0 if pause else 0.0], device=device)
                dist.all_reduce(flag)
                pause = bool(flag.item() > 0)
            if pause:
                return  # the supervisor restarts the job bigger from this checkpoint
