"""A complete custom training loop for elastic-train.

Submit it with ``"workload": "examples.custom_train_loop:train_loop"`` once the service
allows the module (``ETRAIN_ENTRYPOINT_MODULES='["examples.custom_train_loop"]'``) and the
module is importable on every Ray node. Every worker calls ``train_loop(config, ctx)``:

- ``config["hyperparameters"]`` is the job spec's ``hyperparameters``, as submitted;
- ``ctx`` makes the loop elastic and distributed without it knowing how: the model is
  restored from the newest checkpoint and wrapped as the spec's ``distributed`` options say
  (DDP or FSDP, gradient compression, local SGD), the data order resumes at the exact
  sample where the checkpoint was taken, the global batch stays whole at any world size,
  and checkpoints, metrics and pauses for a resize happen between the steps.

The model here learns y = sin(x0) + x1 * x2 from a seeded table of points.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.train.context import MicroBatch, TrainContext


def make_points(n: int, seed: int) -> TensorDataset:
    """The same table on every worker: build data deterministically (or read a file)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g) * 4 - 2
    y = torch.sin(x[:, 0]) + x[:, 1] * x[:, 2]
    return TensorDataset(x, y)


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # One loss per sample: the context weights them to the exact mean over the global batch.
    return (outputs.squeeze(1) - targets) ** 2


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hp = config["hyperparameters"]
    seed = int(hp.get("seed", 0))
    train, held_out = make_points(4096, seed), make_points(512, seed + 1)

    torch.manual_seed(seed)  # the same initial weights on every worker
    model = ctx.prepare_model(
        nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    )
    # Build the optimizer from the *prepared* model's parameters (FSDP replaces them).
    optimizer = ctx.prepare_optimizer(
        torch.optim.Adam(model.parameters(), lr=float(hp.get("learning_rate", 3e-3)))
    )

    def forward(micro: MicroBatch) -> torch.Tensor:
        # The loop's own forward pass over one micro-batch (rows of this worker's share, on
        # its device): any model call, any loss, as long as it gives one loss per sample.
        return squared_error(model(micro.inputs), micro.targets)

    def clip() -> None:
        # Between the last backward pass and the optimizer step: the gradients are the
        # global batch's, combined across the workers.
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)

    for batch in ctx.batches(
        train,
        global_batch_size=int(hp.get("global_batch_size", 128)),
        epochs=int(hp.get("epochs", 4)),
        seed=seed,
        lr_schedule="cosine",
        report_every_steps=int(hp.get("report_every_steps", 8)),
    ):
        # The step's mean loss over the global batch, the same on every worker (None only
        # in place, for a step a lost peer cut short: it comes again).
        loss = ctx.train_step(batch, forward=forward, before_step=clip)
        if batch.ends_epoch:
            if ctx.rank == 0 and loss is not None:
                print(f"step {batch.step}: loss {loss:.4f}", flush=True)
            # Collective: every worker evaluates its part of the held-out set.
            ctx.evaluate(held_out, loss_per_sample=squared_error)
            ctx.report(lr=optimizer.param_groups[0]["lr"])
    # Reached only when the run is complete (a pause for a resize leaves through the loop).
    if ctx.rank == 0:
        print(f"done at step {ctx.step}")
