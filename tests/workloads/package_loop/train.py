"""A ``train_loop`` uploaded with its job (``etrain submit job.yaml --code .``) and run
with the ``ctx`` API: float64, so a test can compare it with one uninterrupted process."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from points import table
from torch import nn


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum(dim=1)


def train_loop(config: dict[str, Any], ctx: Any) -> None:
    hp = config["hyperparameters"]
    torch.manual_seed(0)
    model = ctx.prepare_model(
        nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)), dtype=torch.float64
    )
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if ctx.rank == 0:
        # Whether this process holds Ray (a worker actor does; the confined child must not).
        print(f"loop: rank 0 of {ctx.world_size}, ray loaded: {'ray' in sys.modules}", flush=True)
    pace = float(hp.get("pace_s", 0.0))
    for batch in ctx.batches(
        table(512, 0), global_batch_size=32, max_steps=int(hp["steps"]), seed=0
    ):
        ctx.train_step(batch, squared_error)
        time.sleep(pace)
    own = os.environ.get("ETRAIN_CHECKPOINT_DIR")
    if ctx.rank == 0 and own:
        torch.save(
            {"step": ctx.step, "model": getattr(model, "module", model).state_dict()},
            os.path.join(own, "final.pt"),
        )
        print(f"done at step {ctx.step}", flush=True)
