"""Loading a step's samples in DataLoader worker processes without changing what is loaded.

The sampler addresses every item as ``(epoch, index)``: the epoch travels with the index
into whichever process reads the item, so a dataset with ``set_epoch`` (``PerSampleRandom``)
is told the epoch of that very item there, and not whichever epoch the main process
reached (with prefetching it may be a step or an epoch ahead, and a worker process holds a
copy of the dataset that the main process's ``set_epoch`` never reaches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from elastic.train.micro_batch import map_tensors

Key = tuple[int, int]  # (epoch, dataset index)


@dataclass(frozen=True)
class LoaderOptions:
    """The DataLoader settings ``ctx.batches`` takes from a loop. They change how fast the
    samples come, never which samples or how they are augmented."""

    num_workers: int = 0
    # None: pinned when the worker's device is a GPU.
    pin_memory: bool | None = None
    persistent_workers: bool = False
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be 0 or more, not {self.num_workers}")
        if self.num_workers == 0 and (self.persistent_workers or self.prefetch_factor):
            # DataLoader's own rule, said before any step runs.
            raise ValueError("persistent_workers and prefetch_factor need num_workers > 0")

    def loader_kwargs(self, device: torch.device) -> dict[str, Any]:
        pin = device.type == "cuda" if self.pin_memory is None else self.pin_memory
        kwargs: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": pin}
        if self.num_workers > 0:
            kwargs["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


def keys(epoch: int, indices: list[int]) -> list[Key]:
    return [(epoch, i) for i in indices]


class EpochItems(Dataset[Any]):
    """``dataset`` addressed by ``(epoch, index)``: its ``set_epoch``, when it has one, is
    called with the item's epoch right before the item is read, in the process reading it."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset
        self._epoch: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _at(self, epoch: int) -> None:
        if epoch != self._epoch:
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
            self._epoch = epoch

    def __getitem__(self, key: Key) -> Any:
        epoch, index = key
        self._at(epoch)
        return self.dataset[index]

    def __getitems__(self, batch: list[Key]) -> list[Any]:
        # Looked up on the class: PerSampleRandom forwards unknown attributes to the dataset
        # it wraps, and that one's batched read would skip the per-sample seeding.
        batched = getattr(type(self.dataset), "__getitems__", None)
        epochs = {epoch for epoch, _ in batch}
        if batched is None or len(epochs) != 1:
            return [self[key] for key in batch]
        self._at(epochs.pop())
        return list(batched(self.dataset, [index for _, index in batch]))


def as_list(samples: list[Any]) -> list[Any]:
    """The collate function of a worker that only reads samples; the main process collates
    the step's samples together (at module level: a spawned worker unpickles it)."""
    return samples


class ChunkFeed(Sampler[list[Key]]):
    """The batch sampler of an in-place replica's loader: each ``iter`` yields the chunks
    of the one step set last, so no sample is read before the quorum that trains it has
    chosen it."""

    def __init__(self) -> None:
        self.chunks: list[list[Key]] = []

    def set_step(self, step_keys: list[Key], workers: int) -> None:
        """The step's items split into at most ``workers`` contiguous chunks, read in
        parallel and handed back in order."""
        size = max(1, -(-len(step_keys) // max(1, workers)))
        self.chunks = [step_keys[i : i + size] for i in range(0, len(step_keys), size)]

    def __iter__(self) -> Iterator[list[Key]]:
        return iter(list(self.chunks))

    def __len__(self) -> int:
        return len(self.chunks)


class StepReader:
    """Reads the samples of one step at a time, for a loop whose steps' samples are known
    only when the step starts (an in-place replica's: its quorum chooses them). Worker
    processes, when asked for, read the step's samples in parallel and stay up between
    steps (a per-step start would cost more than the reads); nothing is read ahead."""

    def __init__(
        self,
        dataset: Dataset[Any],
        collate: Callable[[list[Any]], Any],
        options: LoaderOptions,
        device: torch.device,
    ) -> None:
        self.items = EpochItems(dataset)
        self.collate = collate
        self.workers = options.num_workers
        kwargs = options.loader_kwargs(device)
        # Pinned once collated: a worker's samples are stacked here, into fresh memory.
        self.pin = bool(kwargs.pop("pin_memory"))
        self.feed = ChunkFeed()
        self.loader: DataLoader[Any] | None = None
        if self.workers > 0:
            kwargs["persistent_workers"] = True
            self.loader = DataLoader(
                self.items,
                batch_sampler=self.feed,
                collate_fn=as_list,
                # The loader's own: seeding its workers draws nothing from the process's
                # stream (see elastic.train.context._detached_generator).
                generator=torch.Generator(),
                **kwargs,
            )

    def read(self, step_keys: list[Key]) -> Any:
        if self.loader is None:
            samples = [self.items[key] for key in step_keys]
        else:
            self.feed.set_step(step_keys, self.workers)
            samples = [sample for chunk in self.loader for sample in chunk]
        batch = self.collate(samples)
        if self.pin:
            batch = map_tensors(batch, lambda t: t.pin_memory())
        return batch
