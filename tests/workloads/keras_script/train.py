"""A Keras script for ``tf.distribute.MultiWorkerMirroredStrategy``, with nothing of
elastic-train's but its optional ``report``: the strategy reads ``TF_CONFIG``, and
``tf.keras.callbacks.BackupAndRestore`` backs up every epoch into ``ETRAIN_CHECKPOINT_DIR``,
from which a restarted run, at any number of workers, resumes.

It runs on Keras 2 (the ``tf-keras`` package, chosen by ``TF_USE_LEGACY_KERAS``): Keras 3's
``Model.fit`` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585), and its
``BackupAndRestore`` writes one file from every worker, where Keras 2's lets only the chief
write the shared directory."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

# Before TensorFlow is imported: tf.keras is then Keras 2, from tf-keras.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import tensorflow as tf

try:
    from elastic_train import report
except ImportError:  # run without elastic-train installed

    def report(step: int, **metrics: float | None) -> bool:
        return False


GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 4


def data() -> tuple[np.ndarray, np.ndarray]:
    """The same samples on every worker and every run: the strategy shards them."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * STEPS_PER_EPOCH, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32") + 0.1
    return x, y


class Progress(tf.keras.callbacks.Callback):
    """Says where each run starts, reports each epoch's loss, and paces the epochs (so
    that a test can stop the job part-way)."""

    def __init__(self, rank: int, world: int, pace: float) -> None:
        super().__init__()
        self.rank, self.world, self.pace = rank, world, pace
        self.started = False

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.started:  # the first epoch this run trains: after the restored ones
            self.started = True
            restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            print(
                f"worker {self.rank} of {self.world} starts at epoch {epoch} (restart {restarts})",
                flush=True,
            )

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        loss = float((logs or {})["loss"])
        print(f"worker {self.rank} epoch {epoch + 1} loss {loss:.6f}", flush=True)
        report(step=epoch + 1, loss=loss)
        time.sleep(self.pace)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--checkpoint-dir", default=os.environ.get("ETRAIN_CHECKPOINT_DIR", "."))
    args = parser.parse_args()

    # One thread per op: the workers share the node's cores with each other.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    rank = int(task.get("index", 0))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    world = strategy.num_replicas_in_sync

    x, y = data()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
    with strategy.scope():
        # Zeros, not a random start: a test computes the same training in NumPy.
        dense = tf.keras.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros")
        model = tf.keras.Sequential([tf.keras.Input((4,)), dense])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(
        dataset,
        epochs=args.epochs,
        verbose=0,
        callbacks=[
            tf.keras.callbacks.BackupAndRestore(os.path.join(args.checkpoint_dir, "backup")),
            Progress(rank, world, args.pace),
        ],
    )
    if rank == 0:
        kernel, bias = (w.tolist() for w in model.get_weights())
        print(f"weights {json.dumps({'kernel': kernel, 'bias': bias})}", flush=True)
        trained = len(history.epoch)
        print(f"done at epoch {args.epochs} ({trained} trained in this run)", flush=True)


if __name__ == "__main__":
    main()
