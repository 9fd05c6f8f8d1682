"""The README's image classification from a custom entrypoint that first reports to the
job's log how many threads torch computes with in the worker, and how many CPUs Ray gave
the worker (``OMP_NUM_THREADS``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from elastic.train.context import TrainContext
from jobs.workloads import image_classification

MARKER = "THREADS "
ENTRYPOINT = f"{__name__}:train_loop"


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    threads = {"torch": torch.get_num_threads(), "cpus": os.environ.get("OMP_NUM_THREADS")}
    print(MARKER + json.dumps(threads), flush=True)
    image_classification.train_loop(config, ctx)
