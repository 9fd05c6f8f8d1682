"""A custom entrypoint that trains a little and talks on every channel a user might."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch

from elastic.train.context import TrainContext


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    rank = ctx.rank
    hp = config["hyperparameters"]
    print(f"hello from rank {rank}")
    print(f"rank {rank} to stderr", file=sys.stderr)
    logging.getLogger("user.code").warning("rank %d logs a warning", rank)
    warnings.warn(f"rank {rank} warns", stacklevel=1)
    model = torch.nn.Linear(4, 1)
    for step in range(int(hp.get("steps", 3))):
        model(torch.randn(8, 4)).sum().backward()
        print(f"rank {rank} step {step}")
