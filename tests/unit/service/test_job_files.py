"""A job's own directory as a tar stream (``service.job_files``), from a directory and from a
bucket: exact bytes, links stored as links and never followed, special files left out, and
nothing for a directory that is missing, empty or itself a link."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.job_files import CHUNK, FileShrank, find
from tests.s3_server import S3Server, s3_server

BIG = bytes(range(256)) * ((CHUNK + 1000) // 256)  # more than one chunk, not whole blocks
SECRET = b"the service's own database"


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return {m.name: m for m in tar.getmembers()}


def contents(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def written(root: Path, outside: Path) -> Path:
    job = root / "job"
    (job / "a" / "b").mkdir(parents=True)
    (job / "a" / "b" / "deep.txt").write_text("deep")
    (job / "weights.bin").write_bytes(BIG)
    (job / "empty").write_bytes(b"")
    (job / "run.sh").write_text("#!/bin/sh\n")
    (job / "run.sh").chmod(0o4777)
    (job / "empty-dir").mkdir()
    (job / "leak").symlink_to(outside / "service.db")
    (job / "leak-dir").symlink_to(outside, target_is_directory=True)
    (job / "latest").symlink_to("a/b/deep.txt")
    os.mkfifo(job / "pipe")
    return job


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "service"
    path.mkdir()
    (path / "service.db").write_bytes(SECRET)
    return path


def test_the_directory_streams_byte_for_byte_and_links_stay_links(
    tmp_path: Path, outside: Path
) -> None:
    job = written(tmp_path, outside)
    found = find(str(job), "j1")
    assert found is not None
    data = b"".join(found.chunks())
    assert len(data) % tarfile.RECORDSIZE == 0
    assert SECRET not in data
    got = members(data)
    assert sorted(got) == [
        "j1",
        "j1/a",
        "j1/a/b",
        "j1/a/b/deep.txt",
        "j1/empty",
        "j1/empty-dir",
        "j1/latest",
        "j1/leak",
        "j1/leak-dir",
        "j1/run.sh",
        "j1/weights.bin",
    ]  # no FIFO
    assert contents(data) == {
        "j1/a/b/deep.txt": b"deep",
        "j1/empty": b"",
        "j1/run.sh": b"#!/bin/sh\n",
        "j1/weights.bin": BIG,
    }
    assert got["j1/leak"].issym() and got["j1/leak"].linkname == str(outside / "service.db")
    assert got["j1/leak-dir"].issym() and got["j1/latest"].linkname == "a/b/deep.txt"
    assert got["j1/run.sh"].mode == 0o755  # no set-uid, no one else's write
    assert got["j1/a"].isdir() and got["j1/empty-dir"].isdir()


def test_nothing_is_found_where_the_job_wrote_nothing_or_its_directory_is_a_link(
    tmp_path: Path, outside: Path
) -> None:
    assert find(str(tmp_path / "missing"), "j") is None
    (tmp_path / "empty").mkdir()
    assert find(str(tmp_path / "empty"), "j") is None
    (tmp_path / "swapped").symlink_to(outside, target_is_directory=True)
    assert find(str(tmp_path / "swapped"), "j") is None


def test_a_large_file_cut_shorter_while_it_is_sent_ends_the_stream(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "big").write_bytes(BIG + BIG)
    found = find(str(job), "j")
    assert found is not None
    chunks = found.chunks()
    sent = b""
    while len(sent) < CHUNK:
        sent += next(chunks)
    (job / "big").write_bytes(b"short")
    with pytest.raises(FileShrank):
        list(chunks)


def test_a_growing_file_is_sent_at_its_size_when_opened(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "log").write_bytes(BIG)
    found = find(str(job), "j")
    assert found is not None
    chunks = found.chunks()
    sent = next(chunks) + next(chunks) + next(chunks)  # the top, the header, the first chunk
    with (job / "log").open("ab") as fh:
        fh.write(b"appended")
    assert contents(sent + b"".join(chunks)) == {"j/log": BIG}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def test_a_directory_in_a_bucket_streams_the_same_way(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    prefix = "etrain/_files/owner/job"
    client = s3.client()
    for key, body in (
        ("a/b/deep.txt", b"deep"),
        ("weights.bin", BIG),
        ("top.txt", b"top"),
        ("x.gz", b"not gzip"),
    ):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)
    client.put_object(Bucket=bucket, Key="etrain/_files/owner/jobber/other.txt", Body=SECRET)
    found = find(f"s3://{bucket}/{prefix}", "j")
    assert found is not None
    data = b"".join(found.chunks())
    assert SECRET not in data
    assert contents(data) == {
        "j/a/b/deep.txt": b"deep",
        "j/weights.bin": BIG,
        "j/top.txt": b"top",
        "j/x.gz": b"not gzip",
    }
    assert find(f"s3://{bucket}/etrain/_files/owner/nothing", "j") is None
