"""Where a command job's files go on a node: its code unpacked in a fresh working directory,
and its shared directory under its owner's, each its owner's uid's alone."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from elastic.train.command import CommandPlan, _files_dir, _working_directory

UID = 31_234
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to a uid needs root")


def package(path: Path, **members: bytes) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def plan(tmp_path: Path, code: Path | None = None) -> CommandPlan:
    files = tmp_path / "root" / "_files" / "ownerkey" / "job-1"
    return CommandPlan(["python"], "job-1", "alice", str(code) if code else None, str(files))


@root_only
def test_the_shared_directory_is_the_owners_alone_and_the_root_only_passable(
    tmp_path: Path,
) -> None:
    (tmp_path / "root").mkdir(mode=0o750)
    made = Path(str(_files_dir(plan(tmp_path), UID)))
    assert made == tmp_path / "root" / "_files" / "ownerkey" / "job-1"
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (made, made.parent, made.parent.parent)}
    assert modes == {made: 0o700, made.parent: 0o700, made.parent.parent: 0o711}
    assert (made.stat().st_uid, made.parent.stat().st_uid) == (UID, UID)
    assert stat.S_IMODE((tmp_path / "root").stat().st_mode) == 0o751


@root_only
def test_the_code_is_unpacked_into_a_fresh_directory_given_to_the_owner_then_removed(
    tmp_path: Path,
) -> None:
    code = package(tmp_path / "p.tar.gz", **{"train.py": b"print(1)\n", "lib/util.py": b"x=1\n"})
    with _working_directory(plan(tmp_path, code), UID) as workdir:
        assert (workdir / "train.py").read_bytes() == b"print(1)\n"
        assert (workdir / "lib" / "util.py").read_bytes() == b"x=1\n"
        owned = {p.stat().st_uid for p in [workdir, *workdir.rglob("*")]}
        assert owned == {UID}
        assert stat.S_IMODE(workdir.stat().st_mode) == 0o700
        assert (workdir / ".tmp").is_dir()
    assert not workdir.exists()


def test_an_archive_entry_leaving_the_directory_is_not_unpacked(tmp_path: Path) -> None:
    """The service checked the package when it was uploaded; unpacking checks again."""
    code = package(tmp_path / "bad.tar.gz", **{"../escaped.py": b"x"})
    with (
        pytest.raises(tarfile.OutsideDestinationError),
        _working_directory(plan(tmp_path, code), None),
    ):
        pass
    assert not (Path(os.environ.get("TMPDIR", "/tmp")) / "escaped.py").exists()
