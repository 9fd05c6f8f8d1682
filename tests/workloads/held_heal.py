"""The built-in image-classification workload, with a hold in the middle of the state a
replica sends to a healing joiner: once the ``heal_arm`` file exists, a replica sending its
state by torchft's heal (``PGTransport.send_checkpoint``) sends the metadata and the first
tensor, says so in the job's log (with its Ray node), and holds the rest until the
``heal_release`` file exists. A test kills the sender's node in that window, so the joiner
is left with part of a state. While the ``pace`` file exists, each step waits ``PACE_S``
first, so that the job is still training when a replica placed on a node added late has
started (a process start on a loaded 2-core machine takes seconds; unpaced, the job could
end first). At its end each replica logs a digest of its parameters: every replica must
end on the same model."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import ray

from elastic.train.context import TrainContext
from jobs.workloads import image_classification

HOLD_S = 120.0
PACE_S = 0.2
# PGTransport sends the metadata's length, the metadata, then one tensor at a time, each
# waited for: the hold comes before the fourth send, with the first tensor delivered.
HOLD_BEFORE_SEND = 4


class HeldSends:
    """A process group whose ``send`` holds before send ``HOLD_BEFORE_SEND``."""

    def __init__(self, pg: Any, release: str) -> None:
        self._pg, self._release, self._sends = pg, release, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        self._sends += 1
        if self._sends == HOLD_BEFORE_SEND:
            node = ray.get_runtime_context().get_node_id()
            print(f"[held-heal] sent part of its state from node {node}", flush=True)
            deadline = time.monotonic() + HOLD_S
            while not os.path.exists(self._release) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self._pg.send(tensors, dst, tag=tag)


def hold_heals_midway(arm: str, release: str) -> None:
    """In this replica's process: a heal sent while armed (and not yet released) holds
    midway."""
    from torchft.checkpointing.pg_transport import PGTransport

    send_checkpoint = PGTransport.send_checkpoint
    if getattr(send_checkpoint, "held", False):
        return

    def held_send_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        if not os.path.exists(arm) or os.path.exists(release):
            return send_checkpoint(self, *args, **kwargs)
        pg = self._pg
        self._pg = HeldSends(pg, release)
        try:
            return send_checkpoint(self, *args, **kwargs)
        finally:
            self._pg = pg

    held_send_checkpoint.held = True  # type: ignore[attr-defined]
    PGTransport.send_checkpoint = held_send_checkpoint  # type: ignore[method-assign]


def parameters_digest(tensors: Any) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class PacedContext:
    """The job's context, with every batch held ``PACE_S`` while the pace file exists: time
    only, so the training (and its exactness) is unchanged."""

    def __init__(self, ctx: TrainContext, pace: str) -> None:
        self._ctx, self._pace = ctx, pace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def batches(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for batch in self._ctx.batches(*args, **kwargs):
            if os.path.exists(self._pace):
                time.sleep(PACE_S)
            yield batch


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hyperparameters = dict(config["hyperparameters"])
    hold_heals_midway(
        str(hyperparameters.pop("heal_arm")), str(hyperparameters.pop("heal_release"))
    )
    pace = str(hyperparameters.pop("pace"))
    paced: Any = PacedContext(ctx, pace)
    image_classification.train_loop({**config, "hyperparameters": hyperparameters}, paced)
    digest = parameters_digest(ctx.model.state_dict().values())
    print(f"[held-heal] final parameters {digest}", flush=True)
