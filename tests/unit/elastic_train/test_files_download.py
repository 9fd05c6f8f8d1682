"""Unpacking a job's files on the client (``elastic_train.files_download``): what the job
wrote arrives, links that leave its directory are left out, and an archive that would write
outside the destination is refused whole."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from elastic_train.checkpoint_download import staging
from elastic_train.errors import ElasticTrainError
from elastic_train.files_download import destination, unpack


def archive(path: Path, members: list[tuple[str, bytes | str | None]]) -> Path:
    """A tar of ``(name, content)``: bytes a file, str a symlink's target, None a directory."""
    with tarfile.open(path, "w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return path


def unpacked(tmp_path: Path, members: list[tuple[str, bytes | str | None]]) -> Path:
    dest = destination(tmp_path / "out", "j1")
    with staging(dest) as stage:
        return unpack(archive(stage / "files.tar", members), stage, dest, "j1")


def test_files_arrive_and_links_that_leave_are_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dest = unpacked(
        tmp_path,
        [
            ("j1", None),
            ("j1/a", None),
            ("j1/a/x.bin", b"\x00\xff"),
            ("j1/inside", "a/x.bin"),
            ("j1/absolute", "/etc/passwd"),
            ("j1/a/climbs", "../../../../etc"),
            ("j1/parent", ".."),  # inside the unpacking directory, outside the job's
        ],
    )
    assert dest == tmp_path / "out" / "j1"
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == [
        "a",
        "a/x.bin",
        "inside",
    ]
    assert (dest / "inside").read_bytes() == b"\x00\xff"
    for name in ("j1/absolute", "j1/a/climbs", "j1/parent"):
        assert name in caplog.text
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["j1"]  # no staging left


@pytest.mark.parametrize(
    "members",
    [
        [("j1", None), ("j1/../../evil", b"x")],
        [("j1", None), ("/tmp/evil", b"x")],
        [("j1", None), ("other", None)],
    ],
)
def test_an_archive_that_writes_outside_the_job_is_refused_whole(
    tmp_path: Path, members: list[tuple[str, bytes | str | None]]
) -> None:
    with pytest.raises(ElasticTrainError, match="nothing was kept"):
        unpacked(tmp_path, members)
    assert list((tmp_path / "out").iterdir()) == []
    assert not (tmp_path / "evil").exists()


def test_an_existing_destination_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "j1").mkdir()
    with pytest.raises(ElasticTrainError, match="already exists"):
        destination(tmp_path, "j1")
