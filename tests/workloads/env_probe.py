"""A custom entrypoint that reports which environment variable NAMES a job's worker sees
(never their values), to the job's log."""

from __future__ import annotations

import json
import os
from typing import Any

from elastic.train.context import TrainContext

MARKER = "ENV-NAMES "


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    print(MARKER + json.dumps(sorted(os.environ)), flush=True)
