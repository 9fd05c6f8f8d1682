"""The checkpoint registry, the background writer and the per-rank random streams, on one
process (no process group): the same code a worker runs at each checkpoint."""

from __future__ import annotations

import io
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from elastic.checkpoint.directory import CheckpointDir
from elastic.checkpoint.parts import (
    CheckpointState,
    RankRng,
    ReplicatedModel,
    Value,
    rank_seed,
    rng_streams,
    seed_rank,
    set_rng_streams,
)
from elastic.checkpoint.storage import LocalCheckpointStorage
from elastic.checkpoint.writer import STATE_FILE, CheckpointManager, cpu_copy, save_unchecked
from elastic.train.worker import WorkerContext
from elastic_train import render


def test_each_part_gets_its_own_state_back_when_registered() -> None:
    got: dict[str, Any] = {}
    state = CheckpointState({"step": 7, "sampler": {"epoch": 1, "consumed": 5}})
    assert state.register("step", Value(lambda: 0, lambda v: got.update(step=v)))
    assert state.register("sampler", Value(lambda: None, lambda v: got.update(sampler=v)))
    assert not state.register("user", Value(lambda: {"a": 1}, lambda v: got.update(user=v)))
    assert got == {"step": 7, "sampler": {"epoch": 1, "consumed": 5}}
    assert state.replicated_state() == {"step": 0, "sampler": None, "user": {"a": 1}}
    with pytest.raises(ValueError, match="'step' registered twice"):
        state.register("step", Value(lambda: 0, lambda v: None))


def test_a_fresh_start_restores_nothing() -> None:
    state = CheckpointState(None)
    model = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not state.register("model", ReplicatedModel(model))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_snapshot_is_a_copy_training_cannot_change() -> None:
    t = torch.ones(3)
    snap = cpu_copy({"w": t, "nested": [t, (t, 3)], "n": 1.5})
    t.add_(1)
    assert torch.equal(snap["w"], torch.ones(3)) and torch.equal(
        snap["nested"][1][0], torch.ones(3)
    )
    assert snap["n"] == 1.5 and snap["nested"][1][1] == 3


def test_a_state_saved_without_zip_checksums_loads_bit_for_bit_and_torch_save_keeps_them(
    tmp_path: Path,
) -> None:
    from torch.utils.serialization import config

    state = {"w": torch.randn(64, 64, dtype=torch.float64), "step": 3}
    save_unchecked(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
    assert config.save.compute_crc32 is True  # only the checkpoint's own save skipped it


def test_random_streams_survive_a_weights_only_round_trip() -> None:
    seed_rank(5, 0)
    saved = rng_streams()
    buffer = io.BytesIO()
    torch.save({"per_rank": [saved]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["per_rank"][0]
    expected = (torch.rand(3), np.random.rand(3).tolist(), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    set_rng_streams(loaded)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.random.rand(3).tolist() == expected[1] and random.random() == expected[2]


def test_ranks_draw_different_noise_and_a_new_rank_gets_a_stream_of_its_own() -> None:
    assert len({rank_seed(1, r) for r in range(8)}) == 8
    assert rank_seed(1, 0) != rank_seed(2, 0) and rank_seed(1, 3, step=10) != rank_seed(1, 3)
    draws = []
    for rank in (0, 1):
        seed_rank(1, rank)
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])
    # Saved at world 1, resumed at world 2: rank 0 carries on, rank 1 starts afresh.
    seed_rank(1, 0)
    per_rank = [rng_streams()]
    expected = torch.rand(2)
    rank0 = RankRng(0, 1, lambda: 10, lambda s: [s])
    rank0.load_state_dict({"per_rank": per_rank})
    assert torch.equal(torch.rand(2), expected)
    rank1 = RankRng(1, 1, lambda: 10, lambda s: [s])
    rank1.load_state_dict({"per_rank": per_rank})
    seed_rank(1, 1, 10)
    fresh = torch.rand(2)
    rank1.load_state_dict({"per_rank": per_rank})
    assert torch.equal(torch.rand(2), fresh)


class GatedStorage(LocalCheckpointStorage):
    """Local storage whose commit waits until the test opens the gate (a slow disk)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.committing = threading.Event()

    def commit(self, staged: Path, name: str, manifest: dict[str, Any]) -> None:
        self.committing.set()
        assert self.gate.wait(10)
        super().commit(staged, name, manifest)


def test_training_waits_for_the_copy_only_and_one_write_at_a_time(tmp_path: Path) -> None:
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=1, keep=5)
    storage = GatedStorage(tmp_path)
    worker.checkpoints = CheckpointDir(tmp_path, storage)
    manager = CheckpointManager(worker)
    weights = torch.zeros(4)
    manager.state.register("weights", Value(lambda: weights, lambda v: None))
    worker.completed_step = 10

    manager.save(10)  # returns while the write waits on the storage
    assert storage.committing.wait(10)
    weights.add_(1)  # training goes on and changes the state
    worker.completed_step = 11
    assert worker.local_events == [] and manager.writer.busy

    second = threading.Thread(target=manager.save, args=(12,))
    second.start()
    time.sleep(0.2)
    assert second.is_alive()  # the second checkpoint waits for the first write
    storage.gate.set()
    second.join(10)
    manager.wait()

    saved = [d for k, d in worker.local_events if k == "checkpoint_saved"]
    assert [(d["step"], d["completed_step"]) for d in saved] == [(10, 11), (12, 11)]
    first = torch.load(Path(saved[0]["path"]) / STATE_FILE, weights_only=True)
    assert torch.equal(first["weights"], torch.zeros(4))  # the state as it was at step 10
    later = torch.load(Path(saved[1]["path"]) / STATE_FILE, weights_only=True)
    assert torch.equal(later["weights"], torch.ones(4))


def test_the_log_line_of_a_save_gives_its_size_as_etrain_checkpoints_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One unit for sizes a user reads: binary (KiB, MiB), in the job's log as in the CLI."""
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=1, keep=5)
    manager = CheckpointManager(worker)
    weights = torch.zeros(1)
    manager.state.register("weights", Value(lambda: weights, lambda v: None))
    for step, elements in ((10, 16 << 10), (20, 1 << 20)):  # 64 KiB, then 4 MiB of float32
        weights = torch.zeros(elements)
        manager.save(step)
        manager.wait()
    sizes = [d["size_bytes"] for k, d in worker.local_events if k == "checkpoint_saved"]
    logged = [line for line in capsys.readouterr().out.splitlines() if " saved (" in line]
    assert logged == [
        f"[elastic-train] checkpoint of step {step} saved ({render.size(n)})"
        for step, n in zip((10, 20), sizes, strict=True)
    ]
    assert [line.rsplit(" ", 1)[1] for line in logged] == ["KiB)", "MiB)"]


def test_a_failed_write_surfaces_on_the_training_thread(tmp_path: Path) -> None:
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=1)
    manager = CheckpointManager(worker)
    manager.state.register("lock", Value(lambda: threading.Lock(), lambda v: None))
    manager.save(3)  # a lock does not pickle: the background write fails
    with pytest.raises(TypeError):
        manager.wait()
    assert not list(tmp_path.glob(".tmp-*")) and CheckpointDir(tmp_path).existing() == []
    manager.wait()  # reported once


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("echo pwned",))


def test_sharded_checkpoints_load_without_the_standard_unpickler(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from elastic.checkpoint.writer import SHARDED_DIR, load_model, sharded_reader

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    checkpoint = tmp_path / "step_0000000001"
    (checkpoint / SHARDED_DIR).mkdir(parents=True)
    torch.save({"step": 1}, checkpoint / STATE_FILE)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(
        {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=str(checkpoint / SHARDED_DIR),
        no_dist=True,
    )
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    load_model(checkpoint, fresh)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name

    (checkpoint / SHARDED_DIR / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(pickle.UnpicklingError, match=r"may not name posix\.system"):
        sharded_reader(checkpoint / SHARDED_DIR).read_metadata()


def test_parameters_are_copied_while_the_next_step_computes(tmp_path: Path) -> None:
    """What only the optimizer step changes is copied by the writer thread; the next
    optimizer step waits for that copy (before_update), so the checkpoint holds the state
    of its own step."""
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=1)
    storage = GatedStorage(tmp_path)
    worker.checkpoints = CheckpointDir(tmp_path, storage)
    param = torch.zeros(1 << 20)
    buffer = torch.zeros(4)  # written by forwards: copied at once
    manager = CheckpointManager(worker, lambda: [param])
    manager.state.register("model", Value(lambda: {"w": param, "b": buffer}, lambda v: None))
    manager.save(1)
    buffer.add_(5)  # the next forward
    manager.before_update()
    param.add_(1)  # the next optimizer step
    storage.gate.set()
    manager.wait()
    (saved,) = [d for k, d in worker.local_events if k == "checkpoint_saved"]
    state = torch.load(Path(saved["path"]) / STATE_FILE, weights_only=True)
    assert torch.equal(state["model"]["w"], torch.zeros(1 << 20))
    assert torch.equal(state["model"]["b"], torch.zeros(4))


def test_each_checkpoint_holds_its_own_step_though_their_copies_share_buffers(
    tmp_path: Path,
) -> None:
    """Checkpoints copy into buffers kept from one to the next: each still holds the state
    of its own step, in both of its parts (copied at the step, and by the writer thread)."""
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=1, keep=3)
    param = torch.zeros(1 << 16, dtype=torch.float64)
    buffer = torch.zeros(4)
    strided = torch.zeros(4, 6)[:, ::2]  # a view with gaps: copied afresh each time
    manager = CheckpointManager(worker, lambda: [param])
    manager.state.register(
        "model", Value(lambda: {"w": param, "b": buffer, "s": strided}, lambda v: None)
    )
    for step in (1, 2, 3):
        manager.save(step)
        manager.before_update()
        param.add_(1.5)
        buffer.add_(2)
        strided.add_(3)
        manager.wait()
    staged = manager.staging.buffers
    assert {path[-1] for path in staged} == {"w", "b"}  # one buffer each, kept
    for step in (1, 2, 3):
        path = worker.checkpoints.path_for(step)
        state = torch.load(Path(path) / STATE_FILE, weights_only=True)["model"]
        assert torch.equal(
            state["w"], torch.full((1 << 16,), 1.5 * (step - 1), dtype=torch.float64)
        )
        assert torch.equal(state["b"], torch.full((4,), 2.0 * (step - 1)))
        assert torch.equal(state["s"], torch.full((4, 3), 3.0 * (step - 1)))
    assert all(b.data_ptr() not in (param.data_ptr(), buffer.data_ptr()) for b in staged.values())


def test_a_corrupt_checkpoint_found_at_a_save_is_reported_and_leaves_the_list(
    tmp_path: Path,
) -> None:
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=1, keep=1)
    bad = CheckpointDir(tmp_path).save(100, lambda d: torch.save({"step": 100}, d / STATE_FILE))
    (Path(bad.path) / STATE_FILE).write_bytes(b"\0" * bad.size_bytes)
    manager = CheckpointManager(worker)
    manager.state.register("step", Value(lambda: 60, lambda v: None))
    manager.save(60)
    manager.wait()
    kinds = [(k, d["step"]) for k, d in worker.local_events]
    assert kinds == [
        ("checkpoint_saved", 60),
        ("checkpoint_corrupt", 100),
        ("checkpoint_removed", 100),
    ]
    assert [c.step for c in CheckpointDir(tmp_path).existing()] == [60]
