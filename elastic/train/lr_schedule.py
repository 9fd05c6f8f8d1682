"""Learning-rate schedules indexed by optimizer step: a resize changes neither the steps
nor the schedule, so the learning rate carries on as if nothing happened."""

from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, kind: str, warmup_steps: int = 0) -> float:
    """The multiplier of the base learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {kind!r}")
