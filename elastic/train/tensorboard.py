"""TensorBoard event files of a job, written by its rank-0 worker from the events it already
sends to the supervisor: `tensorboard --logdir <checkpoint dir>/<job>/tensorboard` shows the
curves, and text markers where an attempt began (a restore, a resize).

With checkpoints in an object store, the files are written to a local directory and
copied to ``<checkpoint URI>/tensorboard`` at each checkpoint and when the attempt ends
(through ``pyarrow.fs``, as the checkpoints are): the curves in the bucket lag by at most a
checkpoint interval, and what an attempt drew after its last checkpoint on a node that
died is lost with it.

Each attempt opens a new event file in the same directory with ``purge_step`` set to the first step
it trains, so TensorBoard drops the points the failed attempt reported past that step:
the curves show the steps that count, once each.

The checkpoint writer's thread records too (a checkpoint saved) and may finish after the attempt
failed and closed its log: a closed log ignores it, because tensorboardX would reopen a second
event file of the same attempt for it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
import threading
from typing import Any

from elastic.events import EventKind

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

    def __init__(
        self, checkpoint_dir: str, attempt: int, world_size: int, step: int, writer: str = ""
    ) -> None:
        from tensorboardX import SummaryWriter  # installed with Ray; imported where used

        from elastic.checkpoint.storage import is_object_uri

        self.path = directory(checkpoint_dir)
        # Where the writer writes: the directory itself, or a local one copied to the store.
        self.local = self.path
        self.upload_to: str | None = None
        if is_object_uri(checkpoint_dir):
            self.upload_to = self.path
            self.local = tempfile.mkdtemp(prefix="etrain-tensorboard-")
        # The loop's thread and the checkpoint writer's both record: one of them at a time,
        # and one copy to the store at a time.
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()
        self._closed = False
        self.writer = SummaryWriter(
            self.local,
            # Points of earlier attempts after the checkpoint are redone: drop them.
            purge_step=step + 1 if step > 0 else None,
            flush_secs=FLUSH_S,
            # In place, each replica that becomes the quorum's rank 0 writes its own file.
            filename_suffix=f".attempt{attempt}{writer}",
        )
        how = f"from the checkpoint of step {step}" if step > 0 else "from the start"
        self._text(step, f"attempt {attempt} began at world size {world_size}, {how}")

    def record(self, kind: str, data: dict[str, Any]) -> None:
        """One event the worker sends to its supervisor, as TensorBoard points."""
        try:
            with self._lock:
                if self._closed:
                    return
                if kind == EventKind.METRICS:
                    step = int(data["step"])
                    for field, tag in SCALARS.items():
                        value = data.get(field)
                        if isinstance(value, int | float) and math.isfinite(value):
                            self.writer.add_scalar(tag, float(value), step)
                elif kind == EventKind.CHECKPOINT_SAVED:
                    self._text(int(data["step"]), f"checkpoint saved at step {data['step']}")
                    if self.upload_to is not None:  # the copy below takes what is on disk
                        self.writer.flush()
                else:
                    return
            if kind == EventKind.CHECKPOINT_SAVED:
                self._upload()
        except (OSError, KeyError, ValueError) as e:
            log.warning("TensorBoard log: %s", e)

    def _text(self, step: int, text: str) -> None:
        self.writer.add_text(MARKERS, text, step)

    def _upload(self) -> None:
        """Copy the attempt's files to the store (outside ``_lock``: the training loop does
        not wait on the store to draw a point)."""
        if self.upload_to is None:
            return
        from pyarrow import fs as pafs

        with self._upload_lock:
            if not os.path.isdir(self.local):  # closed, copied and removed meanwhile
                return
            store, base = pafs.FileSystem.from_uri(self.upload_to)
            for name in sorted(os.listdir(self.local)):
                pafs.copy_files(
                    os.path.join(self.local, name),
                    f"{base.rstrip('/')}/{name}",
                    destination_filesystem=store,
                )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.writer.close()
            self._upload()
        except OSError as e:
            log.warning("TensorBoard log: %s", e)
        if self.upload_to is not None:
            with self._upload_lock:
                shutil.rmtree(self.local, ignore_errors=True)
