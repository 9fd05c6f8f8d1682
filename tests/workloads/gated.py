"""The image-classification workload, held at a step until a gate file exists: a job that
runs for as long as a test needs, then finishes with a known step count."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from elastic import loop
from jobs.workloads.image_classification import build_dataset, build_model
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters


def train_loop(config: dict[str, Any]) -> None:
    raw = dict(config["hyperparameters"])
    gate, hold_at = str(raw.pop("gate")), int(raw.pop("hold_at_step"))
    hp = ImageClassificationHyperparameters.model_validate(raw)
    criterion = nn.CrossEntropyLoss(reduction="none")
    calls = 0

    def gated_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1  # one micro-batch per step at the full world size
        while calls > hold_at and not os.path.exists(gate):
            time.sleep(0.2)
        return criterion(outputs, targets)

    loop.run(
        {**config, "hyperparameters": raw},
        loop.LoopSettings(global_batch_size=hp.global_batch_size, seed=hp.seed,
                          max_steps=hp.max_steps, epochs=hp.epochs,
                          report_every_steps=hp.report_every_steps),
        loop.TrainingParts(
            model=build_model(hp), dataset=build_dataset(hp),
            make_optimizer=lambda params: torch.optim.SGD(params, lr=hp.learning_rate),
            loss_per_sample=gated_loss,
        ),
    )
