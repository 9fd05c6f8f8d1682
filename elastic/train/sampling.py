"""Resumable, resize-invariant data order.

Every epoch has one seeded permutation of the dataset. Optimizer step ``k`` of an epoch
takes the next ``global_batch`` indices of it, whatever the world size; each rank takes
a contiguous share of that batch. A checkpoint records (epoch, samples consumed), so a
restart at any world size carries on at the exact next sample: none is skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplerPosition:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch already used by completed optimizer steps

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    @classmethod
    def from_dict(cls, data: dict[str, int] | None) -> SamplerPosition:
        return cls(int(data["epoch"]), int(data["consumed"])) if data else cls()


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(dataset_size)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s randomness (its augmentations) in ``epoch``: the
    same whichever rank draws it at whatever world size, and new each epoch."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


def share(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s part of a batch; parts differ by at most one sample."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def steps_per_epoch(dataset_size: int, global_batch: int) -> int:
    return -(-dataset_size // global_batch)


def advance(position: SamplerPosition, dataset_size: int, global_batch: int) -> SamplerPosition:
    """The position after one more optimizer step."""
    consumed = min(position.consumed + global_batch, dataset_size)
    if consumed >= dataset_size:
        return SamplerPosition(position.epoch + 1, 0)
    return SamplerPosition(position.epoch, consumed)


def rank_indices(
    position: SamplerPosition,
    dataset_size: int,
    global_batch: int,
    seed: int,
    world_size: int,
    rank: int,
) -> Iterator[tuple[SamplerPosition, list[int], int]]:
    """From ``position`` on, forever: (position before the step, this rank's indices,
    the step's global batch size). The last step of an epoch may be smaller."""
    perm = epoch_permutation(dataset_size, seed, position.epoch)
    while True:
        batch = perm[position.consumed : position.consumed + global_batch]
        start, end = share(len(batch), world_size, rank)
        yield position, [int(i) for i in batch[start:end]], len(batch)
        nxt = advance(position, dataset_size, global_batch)
        if nxt.epoch != position.epoch:
            perm = epoch_permutation(dataset_size, seed, nxt.epoch)
        position = nxt
