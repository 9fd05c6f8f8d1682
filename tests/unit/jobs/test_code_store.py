"""Code packages kept per owner, in a directory and in a bucket of a real S3-compatible
server on loopback."""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.code_package import CodePackage
from jobs.code_store import CodeStore, owner_key
from tests.s3_server import S3Server, s3_server

DATA = b"\x1f\x8b not really a package, the store does not look"
ID = hashlib.sha256(DATA).hexdigest()
INFO = CodePackage(ID, len(DATA), files=3, unpacked_bytes=120)


def test_a_package_is_stored_once_per_owner_in_private_directories(tmp_path: Path) -> None:
    store = CodeStore(tmp_path / "checkpoints")
    where = tmp_path / "checkpoints" / "_code" / owner_key("alice") / f"{ID}.tar.gz"
    assert owner_key("alice") == hashlib.sha256(b"alice").hexdigest()[:32]
    assert store.location("alice", ID) == str(where)
    assert not store.exists("alice", ID) and store.info("alice", ID) is None

    assert store.put("alice", ID, DATA, INFO) is True
    assert store.put("alice", ID, DATA, INFO) is False
    assert where.read_bytes() == DATA
    assert stat.S_IMODE(where.stat().st_mode) == 0o600
    assert stat.S_IMODE(where.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(where.parent.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in where.parent.iterdir()) == [f"{ID}.json", f"{ID}.tar.gz"]
    assert store.exists("alice", ID) and store.info("alice", ID) == INFO
    assert not store.exists("bob", ID) and store.info("bob", ID) is None


def test_an_id_that_is_not_a_sha256_names_no_path(tmp_path: Path) -> None:
    store = CodeStore(tmp_path)
    for bad in ("../../etc/passwd", ID.upper(), ID[:-1], ""):
        with pytest.raises(ValueError, match="is not a package id"):
            store.location("alice", bad)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def test_a_package_in_a_bucket(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    store = CodeStore(f"s3://{bucket}/etrain/")
    key = f"etrain/_code/{owner_key('alice')}/{ID}"
    assert store.location("alice", ID) == f"s3://{bucket}/{key}.tar.gz"
    assert store.put("alice", ID, DATA, INFO) is True
    assert store.put("alice", ID, DATA, INFO) is False
    assert s3.keys(bucket) == [f"{key}.json", f"{key}.tar.gz"]
    body = s3.client().get_object(Bucket=bucket, Key=f"{key}.tar.gz")["Body"].read()
    assert body == DATA
    assert store.info("alice", ID) == INFO
    assert not store.exists("bob", ID)
