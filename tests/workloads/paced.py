"""The image-classification workload with a step that takes a set time: ``step_s`` divided
by the world size when ``scales`` is true (a job that speeds up with workers), else
``step_s`` at any size (one that does not). The scheduler's sharing is tested on them.
With ``exact`` the model is in the job's ``dtype`` (float64 for a comparison across
resizes), else in float32 whatever it says (the timing tests keep their step's cost)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from elastic.train.context import TrainContext
from jobs.workloads.image_classification import build_datasets, build_model
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    raw = dict(config["hyperparameters"])
    step_s, scales = float(raw.pop("step_s")), bool(raw.pop("scales"))
    exact = bool(raw.pop("exact", False))
    hp = ImageClassificationHyperparameters.model_validate(raw)
    train, _ = build_datasets(hp)
    criterion = nn.CrossEntropyLoss(reduction="none")
    model = ctx.prepare_model(build_model(hp), dtype=getattr(torch, hp.dtype) if exact else None)
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=hp.learning_rate))
    for batch in ctx.batches(
        train,
        hp.global_batch_size,
        epochs=hp.epochs,
        max_steps=hp.max_steps,
        seed=hp.seed,
        report_every_steps=hp.report_every_steps,
        record_samples=hp.record_samples,
    ):
        # In place, the workers training the step are the quorum's replicas.
        workers = getattr(ctx, "participants", ctx.world_size)
        time.sleep(step_s / workers if scales else step_s)
        ctx.train_step(batch, criterion)
