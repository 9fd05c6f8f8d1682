"""A checkpoint as a tar stream: what a download route sends, on a real checkpoint written by
``CheckpointDir`` on disk: exact bytes, an exact length, and a part that changes between
the check and the stream ending it short."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from elastic.checkpoint.directory import CheckpointDir, name_for
from elastic.checkpoint.storage import LocalCheckpointStorage
from service.checkpoint_archive import (
    CHUNK,
    CheckpointDamaged,
    CheckpointUnavailable,
    prepare,
    safe_part,
)

# Bigger than one chunk, and not a multiple of a tar block: the held-back last block and
# the padding are both exercised.
BIG = bytes(range(256)) * ((CHUNK + 1000) // 256)


def saved(root: Path) -> tuple[LocalCheckpointStorage, str]:
    def write(d: Path) -> None:
        (d / "state.pt").write_bytes(BIG)
        (d / "rank1").mkdir()
        (d / "rank1" / "extra.bin").write_bytes(b"x" * 3)
        (d / "empty").write_bytes(b"")

    CheckpointDir(root).save(10, write)
    return LocalCheckpointStorage(root), name_for(10)


def test_the_archive_holds_the_manifest_and_every_part_byte_for_byte(tmp_path: Path) -> None:
    storage, name = saved(tmp_path)
    archive = prepare(storage, name)
    data = b"".join(archive.chunks())
    assert len(data) == archive.size()
    assert len(data) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    on_disk = tmp_path / name
    assert members == {
        f"{name}/manifest.json": (on_disk / "manifest.json").read_bytes(),
        f"{name}/empty": b"",
        f"{name}/rank1/extra.bin": b"xxx",
        f"{name}/state.pt": BIG,
    }
    assert json.loads(members[f"{name}/manifest.json"])["step"] == 10


def test_a_damaged_part_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    storage, name = saved(tmp_path)
    part = tmp_path / name / "state.pt"
    part.write_bytes(b"\xff" + BIG[1:])
    with pytest.raises(CheckpointDamaged) as e:
        prepare(storage, name)
    assert (e.value.part, e.value.reason) == ("state.pt", "fails its checksum (SHA-256)")
    part.unlink()
    with pytest.raises(CheckpointDamaged) as e:
        prepare(storage, name)
    assert (e.value.part, e.value.reason) == ("state.pt", "is missing")


def test_a_removed_checkpoint_is_unavailable(tmp_path: Path) -> None:
    storage, name = saved(tmp_path)
    storage.remove(name)
    with pytest.raises(CheckpointUnavailable):
        prepare(storage, name)


def test_a_part_changed_while_streaming_ends_the_stream_short(tmp_path: Path) -> None:
    storage, name = saved(tmp_path)
    archive = prepare(storage, name)
    (tmp_path / name / "state.pt").write_bytes(BIG[:-1] + b"\x00")  # same size, last byte
    got = b""
    with pytest.raises(CheckpointDamaged) as e:
        for block in archive.chunks():
            got += block
    assert e.value.part == "state.pt"
    assert e.value.reason == "fails its checksum (changed while it was sent)"
    # The part's last block was held back: what went out ends with its first chunk.
    assert got.endswith(BIG[:CHUNK])
    assert len(got) < archive.size()
    with pytest.raises(tarfile.ReadError), tarfile.open(fileobj=io.BytesIO(got)) as tar:
        for m in tar.getmembers():
            tar.extractfile(m).read()  # type: ignore[union-attr]


def test_a_manifest_naming_a_path_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    storage, name = saved(tmp_path)
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointDamaged) as e:
        prepare(storage, name)
    assert e.value.part == "manifest.json"
    assert [safe_part(p) for p in ("a/b.pt", "/etc/x", "a/../b", "", "manifest.json")] == [
        True,
        False,
        False,
        False,
        False,
    ]
