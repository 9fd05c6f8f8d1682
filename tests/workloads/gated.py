"""The image-classification workload, held at a step until a gate file exists: a job that
runs for as long as a test needs, then finishes with a known step count."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from elastic.train.context import TrainContext
from jobs.workloads.image_classification import build_datasets, build_model
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    raw = dict(config["hyperparameters"])
    gate, hold_at = str(raw.pop("gate")), int(raw.pop("hold_at_step"))
    hp = ImageClassificationHyperparameters.model_validate(raw)
    train, _ = build_datasets(hp)
    criterion = nn.CrossEntropyLoss(reduction="none")
    model = ctx.prepare_model(build_model(hp))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=hp.learning_rate))
    for batch in ctx.batches(
        train,
        hp.global_batch_size,
        epochs=hp.epochs,
        max_steps=hp.max_steps,
        seed=hp.seed,
        report_every_steps=hp.report_every_steps,
    ):
        # Step `hold_at` is trained and reported; the one after it waits for the gate.
        while batch.step > hold_at and not os.path.exists(gate):
            time.sleep(0.2)
        ctx.train_step(batch, criterion)
