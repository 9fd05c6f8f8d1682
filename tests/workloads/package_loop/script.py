"""The package's loop written as a script is (``main()``, argparse, its own DataLoader and
an epoch function), ported to the context the way the examples are: ``get_context``,
``ctx.prepare`` and ``ctx.loader``. float64, so a test can compare it with one process."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from points import table
from torch import nn
from torch.utils.data import DataLoader

from elastic.train import get_context


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum(dim=1)


def train_one_epoch(ctx: Any, model: nn.Module, loader: Any, pace: float) -> None:
    for batch in loader:
        ctx.train_step(batch, forward=lambda m: squared_error(model(m.inputs), m.targets))
        time.sleep(pace)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args()
    ctx = get_context()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = ctx.prepare(model, optimizer)
    train_loader = DataLoader(table(512, 0), batch_size=32, shuffle=True)
    train_loader = ctx.loader(train_loader, epochs=args.epochs, seed=0)
    if ctx.rank == 0:
        # Whether this process holds Ray (a worker actor does; the confined child must not).
        print(f"loop: rank 0 of {ctx.world_size}, ray loaded: {'ray' in sys.modules}", flush=True)
    for _ in range(ctx.position.epoch, args.epochs):
        train_one_epoch(ctx, model, train_loader, args.pace)
    own = os.environ.get("ETRAIN_CHECKPOINT_DIR")
    if ctx.rank == 0 and own:
        torch.save(
            {"step": ctx.step, "model": getattr(model, "module", model).state_dict()},
            os.path.join(own, "final.pt"),
        )
        print(f"done at step {ctx.step}", flush=True)


if __name__ == "__main__":
    main()
