"""The built-in workloads: each a name, its validated hyperparameters and its training loop.

The hyperparameter models are plain pydantic, so the service can validate a spec without
importing torch; the training loops are imported by name only inside Ray Train workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from jobs.workloads.text_classification_params import TextClassificationHyperparameters


@dataclass(frozen=True)
class Workload:
    name: str
    hyperparameters: type[BaseModel]
    # "module:function" of the per-worker training loop, resolved on the worker.
    train_loop: str
    # Hyperparameters that name files the workers read: authorized at submission.
    path_fields: tuple[str, ...] = ()


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            name="image-classification",
            hyperparameters=ImageClassificationHyperparameters,
            train_loop="jobs.workloads.image_classification:train_loop",
            path_fields=("data_path", "eval_path"),
        ),
        Workload(
            name="text-classification",
            hyperparameters=TextClassificationHyperparameters,
            train_loop="jobs.workloads.text_classification:train_loop",
            path_fields=("data_path", "eval_path", "vocab_path"),
        ),
    ]
}
