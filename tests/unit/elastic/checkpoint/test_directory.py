import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic.checkpoint.directory import (
    CheckpointDir,
    CheckpointGone,
    CorruptCheckpoint,
    steps_to_delete,
)


def write(payload: bytes):
    def _write(d: Path) -> None:
        (d / "state.pt").write_bytes(payload)

    return _write


def test_save_is_atomic_and_listed(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "job")
    info = ckpts.save(10, write(b"x" * 100))
    assert info.step == 10 and info.size_bytes == 100
    assert Path(info.path).name == "step_0000000010"
    assert [c.step for c in ckpts.existing()] == [10]
    assert not [p for p in (tmp_path / "job").iterdir() if p.name.startswith(".tmp")]
    manifest = json.loads((Path(info.path) / "manifest.json").read_text())
    assert manifest["step"] == 10 and set(manifest["files"]) == {"state.pt"}


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)

    def boom(d: Path) -> None:
        (d / "state.pt").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpts.save(5, boom)
    assert list(tmp_path.iterdir()) == []
    assert ckpts.existing() == []


def test_corrupt_newest_is_skipped_for_the_previous(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    ckpts.save(10, write(b"a" * 50))
    newest = ckpts.save(20, write(b"b" * 50))
    (Path(newest.path) / "state.pt").write_bytes(b"c" * 50)  # same size, other bytes
    with pytest.raises(CorruptCheckpoint, match="fails its checksum"):
        ckpts.verify(newest.path)
    good, skipped = ckpts.latest_valid()
    assert good is not None and good.step == 10
    assert [(s.step, why) for s, why in skipped] == [
        (20, "step_0000000020: state.pt fails its checksum")
    ]


def test_a_checkpoint_retention_removed_is_gone_and_not_corrupt(tmp_path: Path) -> None:
    """What a reader holding an old path (a replica whose attempt began from it) is told
    once retention removed it: gone. One whose manifest is lost but whose parts are there
    is corrupt."""
    ckpts = CheckpointDir(tmp_path)
    first = ckpts.save(10, write(b"a"))
    ckpts.save(20, write(b"b"))
    assert [c.step for c in ckpts.prune(keep=1).removed] == [10]
    assert not ckpts.exists(first.path)
    with pytest.raises(CheckpointGone, match="step_0000000010: removed by retention"):
        ckpts.verify(first.path)
    with pytest.raises(CheckpointGone):
        ckpts.local_copy(first.path)
    damaged = ckpts.save(30, write(b"c"))
    (Path(damaged.path) / "manifest.json").unlink()
    assert ckpts.exists(damaged.path)
    with pytest.raises(CorruptCheckpoint, match="step_0000000030: unreadable manifest"):
        ckpts.verify(damaged.path)


def test_a_missing_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    info = ckpts.save(10, write(b"a"))
    (Path(info.path) / "manifest.json").unlink()
    assert ckpts.existing() == []
    assert ckpts.latest_valid() == (None, [])


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    for step in (10, 20, 30, 40):
        ckpts.save(step, write(b"z"))
    removed = ckpts.prune(keep=2).removed
    assert [r.step for r in removed] == [10, 20]
    assert [c.step for c in ckpts.existing()] == [30, 40]


def test_retention_arithmetic() -> None:
    assert steps_to_delete([30, 10, 20], keep=3) == []
    assert steps_to_delete([30, 10, 20, 40], keep=1) == [10, 20, 30]
    assert steps_to_delete([], keep=2) == []
    assert steps_to_delete([10, 20], keep=0) == [10]  # the newest valid one always stays
    assert steps_to_delete([60, 70], keep=1, protect=[60]) == []


def corrupt(info_path: str) -> None:
    f = Path(info_path) / "state.pt"
    f.write_bytes(b"\0" * f.stat().st_size)


def test_a_corrupt_newer_checkpoint_never_costs_the_good_ones(tmp_path: Path) -> None:
    """keep=1, good 50, corrupt 100: the job resumes from 50 and saves 60; retention keeps
    60, deletes 50, and moves 100 aside instead of counting it."""
    ckpts = CheckpointDir(tmp_path)
    ckpts.save(50, write(b"fifty"))
    corrupt(ckpts.save(100, write(b"hundred")).path)
    resume, skipped = CheckpointDir(tmp_path).latest_valid()
    assert resume is not None and resume.step == 50
    assert [s.step for s, _ in skipped] == [100]

    worker_side = CheckpointDir(tmp_path)
    worker_side.save(60, write(b"sixty"))
    pruned = worker_side.prune(keep=1, protect=60)
    assert [c.step for c in pruned.removed] == [50]
    ((aside, why, where),) = pruned.set_aside
    assert aside.step == 100 and why == "step_0000000100: state.pt fails its checksum"
    assert Path(where).parent == tmp_path / "corrupt" and Path(where).is_dir()
    assert [c.step for c in CheckpointDir(tmp_path).existing()] == [60]
    assert (Path(ckpts.path_for(60)) / "state.pt").read_bytes() == b"sixty"
    assert CheckpointDir(tmp_path).latest_valid()[0].step == 60  # type: ignore[union-attr]


def test_retention_keeps_the_newest_valid_whatever_keep_says(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    ckpts.save(10, write(b"a"))
    corrupt(ckpts.save(20, write(b"b")).path)
    assert ckpts.prune(keep=0).removed == []
    assert [c.step for c in ckpts.existing()] == [10]


def test_the_step_just_written_is_never_pruned(tmp_path: Path) -> None:
    # A valid newer checkpoint (another attempt's) does not push out the one just written.
    ckpts = CheckpointDir(tmp_path)
    ckpts.save(90, write(b"later"))
    ckpts.save(60, write(b"now"))
    assert ckpts.prune(keep=1, protect=60).removed == []
    assert [c.step for c in ckpts.existing()] == [60, 90]


def test_orphaned_staging_directories_are_cleaned(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    ckpts.save(10, write(b"a"))
    with pytest.raises(KeyboardInterrupt), ckpts.staging(20, "dead") as staged:
        (staged / "state.pt").write_bytes(b"half")
        raise KeyboardInterrupt  # the block's own failure cleans up after itself
    (tmp_path / ".tmp-step_0000000030-killed").mkdir()  # a process killed mid-write
    (tmp_path / ".tmp-step_0000000030-killed" / "state.pt").write_bytes(b"half")
    assert ckpts.clean_orphans() == [".tmp-step_0000000030-killed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000000010"]


def test_saving_a_step_again_replaces_it_and_readers_always_see_one(tmp_path: Path) -> None:
    """A restart that redoes step 10 saves it again: a reader polling meanwhile always
    finds a valid step 10 (no moment with neither the old nor the new one)."""
    ckpts = CheckpointDir(tmp_path)
    payload = b"x" * 4096

    def many_files(tag: bytes) -> Callable[[Path], None]:
        def _write(d: Path) -> None:
            for i in range(50):
                (d / f"part{i}").write_bytes(payload)
            (d / "state.pt").write_bytes(tag)

        return _write

    ckpts.save(10, many_files(b"first"))
    seen: list[int | None] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(len(CheckpointDir(tmp_path).existing()))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(6):
            ckpts.save(10, many_files(f"again {n}".encode()))
    finally:
        stop.set()
        t.join()
    assert seen and set(seen) == {1}
    assert (Path(ckpts.path_for(10)) / "state.pt").read_bytes() == b"again 5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000000010"]


def test_a_worker_re_verifies_the_checkpoint_it_loads(tmp_path: Path) -> None:
    import torch

    from elastic.checkpoint.writer import STATE_FILE, CheckpointManager
    from elastic.train.worker import WorkerContext

    info = CheckpointDir(tmp_path).save(10, lambda d: torch.save({"step": 10}, d / STATE_FILE))
    fine = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=10, resume_path=info.path)
    assert CheckpointManager(fine).restored == {"step": 10}
    corrupt(info.path)
    resumed = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=10, resume_path=info.path)
    with pytest.raises(CorruptCheckpoint, match=r"state\.pt fails its checksum"):
        CheckpointManager(resumed)
