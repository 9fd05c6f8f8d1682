"""What the client checks before an upload: the size limit, named with the biggest files,
and the line `etrain submit --code` prints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastic_train.code_archive import pack
from elastic_train.code_upload import packed_within, summary
from elastic_train.errors import CodeTooLarge


def test_an_archive_over_the_limit_is_refused_naming_the_five_biggest_files(
    tmp_path: Path,
) -> None:
    for i, size in enumerate((3000, 100, 5000, 2000, 4000, 1000, 50)):
        (tmp_path / f"f{i}.bin").write_bytes(os.urandom(size))  # incompressible
    archive = pack(tmp_path)
    with pytest.raises(CodeTooLarge) as refused:
        packed_within(tmp_path, max_bytes=4096)
    assert str(refused.value) == (
        f"the code packs to {archive.size_bytes} bytes, over the limit of 4096 bytes; the "
        "biggest files: f2.bin (4.9 KiB), f4.bin (3.9 KiB), f0.bin (2.9 KiB), f3.bin (2.0 KiB), "
        "f5.bin (1000 B) (leave files out with .etrainignore)"
    )
    assert packed_within(archive, max_bytes=archive.size_bytes) is archive


def test_the_summary_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    archive = pack(tmp_path)
    assert (
        summary(archive) == f"1 file, {archive.size_bytes} B packed (id {archive.content_id[:12]})"
    )
