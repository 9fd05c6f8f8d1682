"""A training script written for torchrun, with nothing of elastic-train's but its optional
``report``: DDP on Gloo, a float64 linear model, a checkpoint every few steps into
``ETRAIN_CHECKPOINT_DIR`` (or ``--checkpoint-dir``), resumed from when it is there.

Every step's global batch is drawn from the step's number alone and split across the
ranks, and each rank's loss is scaled so that DDP's average is the global batch's mean:
the model after N steps is the same at any world size and after any restart."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from elastic_train import report
except ImportError:  # run without elastic-train installed

    def report(step: int, **metrics: float | None) -> bool:
        return False


GLOBAL_BATCH = 8


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--checkpoint-dir", default=os.environ.get("ETRAIN_CHECKPOINT_DIR", "."))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    path = os.path.join(args.checkpoint_dir, "state.pt")
    step = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"rank {rank} of {world} starts at step {step} (restart {restarts})", flush=True)
    ddp = DistributedDataParallel(model)
    while step < args.steps:
        x, y = batch(step)
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = ((ddp(x[mine]) - y[mine]) ** 2).sum() * world / GLOBAL_BATCH
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and (step % args.every == 0 or step == args.steps):
            tmp = path + ".tmp"
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                tmp,
            )
            os.replace(tmp, path)
        report(step=step, loss=float(loss))
        time.sleep(args.pace)
    dist.destroy_process_group()
    if rank == 0:
        print(f"done at step {step}", flush=True)


if __name__ == "__main__":
    main()
