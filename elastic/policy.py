"""The sizing policy: how many workers a job gets, given what the cluster has free."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def workers_that_fit(
    free_per_node: Iterable[Mapping[str, float]], per_worker: Mapping[str, float]
) -> int:
    """How many workers of ``per_worker`` resources fit, each within a single node."""
    total = 0
    for free in free_per_node:
        fits = min(
            (int(free.get(name, 0.0) // amount) for name, amount in per_worker.items() if amount),
            default=0,
        )
        total += max(0, fits)
    return total


def choose_world_size(min_workers: int, max_workers: int, fitting: int) -> int | None:
    """The largest size in [min, max] that fits, or None when even min does not."""
    if fitting < min_workers:
        return None
    return min(max_workers, fitting)


def grow_target(world_size: int, max_workers: int, free_fit: int) -> int | None:
    """The size worth a checkpoint-and-restart to grow to, or None. ``free_fit`` counts
    workers that fit in what is free beside the job's own."""
    target = min(max_workers, world_size + free_fit)
    return target if target > world_size else None


def below_min_for_too_long(waited_s: float, grace_s: float) -> bool:
    return waited_s > grace_s
