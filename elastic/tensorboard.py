"""TensorBoard event files of a job, written by its rank-0 worker from the events it already
sends to the supervisor: `tensorboard --logdir <checkpoint dir>/<job>/tensorboard` shows the
curves, and text markers where an attempt began (a restore, a resize).

Each attempt opens a new event file in the same directory with ``purge_step`` set to the first step
it trains, so TensorBoard drops the points the failed attempt reported past that step:
the curves show the steps that count, once each.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

log = logging.getLogger(__name__)

DIRNAME = "tensorboard"
# The metrics event's fields drawn as curves, and their tags.
SCALARS = {
    "loss": "train/loss",
    "accuracy": "train/accuracy",
    "learning_rate": "train/learning_rate",
    "samples_per_s": "train/samples_per_s",
    "world_size": "train/world_size",
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
}
MARKERS = "events"
FLUSH_S = 5


def directory(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, DIRNAME)


def resumed_step(resume_path: str | None) -> int:
    """The step of the checkpoint an attempt starts from (``.../step_0000000050``), 0 if none."""
    found = re.search(r"step_(\d+)$", os.path.normpath(resume_path)) if resume_path else None
    return int(found.group(1)) if found else 0


class TensorBoardLog:
    """Scalars and markers of one attempt; failures to write are logged, never raised: a
    full disk for the curves must not end the training."""

    def __init__(self, checkpoint_dir: str, attempt: int, world_size: int, step: int) -> None:
        from tensorboardX import SummaryWriter  # installed with Ray; imported where used

        self.path = directory(checkpoint_dir)
        self.writer = SummaryWriter(
            self.path,
            # Points of earlier attempts after the checkpoint are redone: drop them.
            purge_step=step + 1 if step > 0 else None,
            flush_secs=FLUSH_S,
            filename_suffix=f".attempt{attempt}",
        )
        how = f"from the checkpoint of step {step}" if step > 0 else "from the start"
        self._text(step, f"attempt {attempt} began at world size {world_size}, {how}")

    def record(self, kind: str, data: dict[str, Any]) -> None:
        """One event the worker sends to its supervisor, as TensorBoard points."""
        try:
            if kind == "metrics":
                step = int(data["step"])
                for field, tag in SCALARS.items():
                    value = data.get(field)
                    if isinstance(value, int | float) and math.isfinite(value):
                        self.writer.add_scalar(tag, float(value), step)
            elif kind == "checkpoint_saved":
                self._text(int(data["step"]), f"checkpoint saved at step {data['step']}")
        except (OSError, KeyError, ValueError) as e:
            log.warning("TensorBoard log: %s", e)

    def _text(self, step: int, text: str) -> None:
        self.writer.add_text(MARKERS, text, step)

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as e:
            log.warning("TensorBoard log: %s", e)
