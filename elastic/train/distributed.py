"""How a job's model is made distributed: DDP or FSDP, gradient compression hooks, mixed
precision, and local SGD's periodic averaging.

``jobs.spec.DistributedSpec`` validates these options at submission (and refuses what cannot
run on the job's hardware); this module only applies them inside a worker, with a process
group already formed (by Ray Train, or by a test's own processes).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistributedOptions:
    """The ``distributed`` part of a job spec, as the worker receives it."""

    backend: str = "auto"
    strategy: str = "ddp"  # "ddp" or "fsdp"
    gradient_compression: str = "none"  # "none", "fp16", "bf16", "powersgd"
    powersgd_rank: int = 1
    powersgd_start_step: int = 2
    bucket_cap_mb: float = 25.0
    precision: str = "fp32"  # "fp32", "bf16", "fp16"
    sync: str = "every_step"  # "every_step" or "local_sgd"
    local_sgd_period: int = 8

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DistributedOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})

    @property
    def local_sgd(self) -> bool:
        return self.sync == "local_sgd"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# -- wrapping ------------------------------------------------------------------------------


def wrap_model(model: nn.Module, options: DistributedOptions, device: torch.device) -> nn.Module:
    """The model on ``device``, made data-parallel as the options say. With local SGD it
    stays unwrapped: workers step on their own gradients and average parameters every
    ``local_sgd_period`` steps instead."""
    model = model.to(device)
    if not is_distributed():
        return model
    if options.strategy == "fsdp":
        return _shard(model)
    if options.local_sgd:
        # Identical starting points: the average of H local steps is then meaningful.
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        return model
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=ids, bucket_cap_mb=options.bucket_cap_mb
    )
    register_compression(ddp, options)
    return ddp


def _shard(model: nn.Module) -> nn.Module:
    """FSDP2: each parameter is split along its first dimension across the workers. Every
    child that holds parameters is its own unit, so only one unit's parameters are
    gathered whole at a time."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    return model


def register_compression(
    ddp: nn.parallel.DistributedDataParallel, options: DistributedOptions
) -> Any:
    """Registers the gradient-compression communication hook; returns its state (PowerSGD's)
    or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kind = options.gradient_compression
    if kind == "none":
        return None
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if kind == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return None
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_step,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    raise ValueError(f"unknown gradient_compression {kind!r}")


def unwrap(model: nn.Module) -> nn.Module:
    return (
        getattr(model, "module", model)
        if isinstance(model, nn.parallel.DistributedDataParallel)
        else model
    )


def is_sharded(model: nn.Module) -> bool:
    # Importing FSDP pulls in torch._dynamo (~1.5 s on 2 cores): only when it can be FSDP.
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Accumulate gradients locally unless ``sync``: DDP's ``no_sync``, FSDP's
    ``set_requires_gradient_sync``. The last micro-batch of a step synchronises."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
        return
    yield


# -- precision -----------------------------------------------------------------------------


class Precision:
    """Autocast for the forward pass and, for fp16, a gradient scaler around the step."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision = precision
        self.device = device
        self.scaler: torch.amp.GradScaler | None = None
        if precision == "fp16":
            if device.type != "cuda":
                raise ValueError("precision fp16 needs a GPU (its grad scaler is CUDA's)")
            self.scaler = torch.amp.GradScaler("cuda")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


# -- local SGD -----------------------------------------------------------------------------


class LocalSGD:
    """Averages the parameters of all workers every ``period`` optimizer steps."""

    def __init__(self, period: int) -> None:
        self.period = period
        self.averaged_at: list[int] = []

    def due(self, step: int) -> bool:
        return step % self.period == 0

    def average(self, model: nn.Module, step: int) -> None:
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        if is_distributed():
            average_parameters(iter(model.parameters()), dist.group.WORLD)  # type: ignore[arg-type]
        self.averaged_at.append(step)
