"""The pieces of a step a loop's own forward pass sees: one micro-batch at a time.

``ctx.train_step(batch, forward=fn)`` calls ``fn(micro)`` once per micro-batch and backs
the per-sample losses it returns up, weighted so that the step minimises their exact mean
over the global batch. What a micro-batch holds is decided by the context (which rows,
padding passes), what is computed from it by the loop (its model call, its loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``[start, end)`` of this worker's share of a step, on its device.

    ``inputs`` and ``targets`` are the two halves of a batch collated from
    ``(inputs, targets)`` samples; any other batch (a dict, a single tensor, a longer
    tuple) is all in ``inputs`` and ``targets`` is None. Tensors are cut by rows (their
    first dimension); anything else in the batch is passed whole."""

    inputs: Any
    targets: Any
    rows: int
    # A pass run only to keep the step's collectives in step (an empty share): one row,
    # the dataset's first sample, whose loss is weighted zero.
    padding: bool = False


# ``fn(micro)`` -> one loss per row of the micro-batch, a tensor of shape ``(micro.rows,)``.
Forward = Callable[[MicroBatch], torch.Tensor]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` on every tensor of a batch: tensors, and mappings, lists and tuples of them.
    A mapping comes back a dict (a Hugging Face ``BatchEncoding`` included), which is what
    ``model(**inputs)`` takes."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def rows(obj: Any, start: int, end: int) -> Any:
    return map_tensors(obj, lambda t: t[start:end])


def split_batch(collated: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a collated batch; targets is None unless its samples were
    ``(inputs, targets)`` pairs."""
    if isinstance(collated, list | tuple) and len(collated) == 2:
        return collated[0], collated[1]
    return collated, None


def micro_batch(inputs: Any, targets: Any, start: int, end: int, padding: bool) -> MicroBatch:
    return MicroBatch(
        inputs=rows(inputs, start, end),
        targets=rows(targets, start, end),
        rows=end - start,
        padding=padding,
    )


def per_sample_losses(losses: Any, micro: MicroBatch) -> torch.Tensor:
    """The forward's result, checked: a mean (a scalar) or a per-token loss would be
    weighted as if it were one loss per sample and the step would no longer minimise the
    global batch's mean, silently."""
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (micro.rows,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)
        raise ValueError(
            f"forward must return one loss per sample, a tensor of shape ({micro.rows},), "
            f"not {shape}: use reduction='none', and reduce any per-token losses of a row "
            "to one value per row"
        )
    return losses
