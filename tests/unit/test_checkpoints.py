import json
from pathlib import Path

import pytest

from elastic.checkpoints import CheckpointDir, CorruptCheckpoint, steps_to_delete


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
    removed = ckpts.prune(keep=2)
    assert [r.step for r in removed] == [10, 20]
    assert [c.step for c in ckpts.existing()] == [30, 40]


def test_retention_arithmetic() -> None:
    assert steps_to_delete([30, 10, 20], keep=3) == []
    assert steps_to_delete([30, 10, 20, 40], keep=1) == [10, 20, 30]
    assert steps_to_delete([], keep=2) == []
