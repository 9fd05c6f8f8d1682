"""Checkpoints in a bucket of a real S3-compatible server on loopback (no Ray)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.checkpoint.directory import CheckpointDir, CorruptCheckpoint
from elastic.checkpoint.storage import ObjectCheckpointStorage, is_object_uri, storage_for
from tests.s3_server import S3Server, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.new_bucket()


def write(payload: bytes):
    def _write(d: Path) -> None:
        (d / "state.pt").write_bytes(payload)
        (d / "sharded").mkdir()
        (d / "sharded" / "__0_0.distcp").write_bytes(payload[::-1])

    return _write


def test_uris_pick_the_object_store_and_paths_the_filesystem(bucket: str) -> None:
    assert is_object_uri("s3://b/p") and is_object_uri("gs://b/p") and is_object_uri("abfs://c/p")
    assert not is_object_uri("/mnt/checkpoints") and not is_object_uri("file:///tmp/x")
    assert isinstance(storage_for(f"s3://{bucket}/job"), ObjectCheckpointStorage)


def test_round_trip_through_the_bucket(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    ckpts = CheckpointDir(f"s3://{bucket}/prefix/job-1")
    info = ckpts.save(10, write(b"ten" * 100))
    assert info.path == f"s3://{bucket}/prefix/job-1/step_0000000010"
    assert info.size_bytes == 600
    assert s3.keys(bucket) == [
        "prefix/job-1/step_0000000010/manifest.json",
        "prefix/job-1/step_0000000010/sharded/__0_0.distcp",
        "prefix/job-1/step_0000000010/state.pt",
    ]
    # A fresh reader (another node) lists from the manifests and restores the parts.
    again = CheckpointDir(f"s3://{bucket}/prefix/job-1/")
    assert [(c.step, c.path, c.size_bytes) for c in again.existing()] == [(10, info.path, 600)]
    best, skipped = again.latest_valid()
    assert best is not None and best.step == 10 and skipped == []
    local = again.local_copy(info.path)
    assert (local / "state.pt").read_bytes() == b"ten" * 100
    assert (local / "sharded" / "__0_0.distcp").read_bytes() == (b"ten" * 100)[::-1]


def test_retention_keeps_the_newest_and_nothing_stays_staged(s3: S3Server, bucket: str) -> None:
    ckpts = CheckpointDir(f"s3://{bucket}/job")
    for step in (10, 20, 30, 40):
        ckpts.save(step, write(f"s{step}".encode()))
        ckpts.prune(keep=2, protect=step)
    assert [c.step for c in ckpts.existing()] == [30, 40]
    assert {k.split("/")[1] for k in s3.keys(bucket)} == {"step_0000000030", "step_0000000040"}
    assert not list(ObjectCheckpointStorage(f"s3://{bucket}/job").staging_root.glob("*"))


def test_a_checkpoint_without_a_manifest_does_not_exist_and_is_cleaned(
    s3: S3Server, bucket: str
) -> None:
    ckpts = CheckpointDir(f"s3://{bucket}/job")
    ckpts.save(10, write(b"good"))
    # What a writer killed mid-upload leaves: parts, no manifest.
    s3.client().put_object(Bucket=bucket, Key="job/step_0000000020/state.pt", Body=b"half")
    assert [c.step for c in ckpts.existing()] == [10]
    best, _ = ckpts.latest_valid()
    assert best is not None and best.step == 10
    assert ckpts.clean_orphans() == ["step_0000000020"]
    assert s3.keys(bucket, "job/step_0000000020") == []
    assert [c.step for c in ckpts.existing()] == [10]


def test_a_corrupt_checkpoint_is_skipped_and_moved_aside(s3: S3Server, bucket: str) -> None:
    ckpts = CheckpointDir(f"s3://{bucket}/job")
    ckpts.save(10, write(b"ten"))
    ckpts.save(20, write(b"twenty"))
    s3.client().put_object(Bucket=bucket, Key="job/step_0000000020/state.pt", Body=b"rotten")
    best, skipped = CheckpointDir(f"s3://{bucket}/job").latest_valid()
    assert best is not None and best.step == 10
    assert [(c.step, why) for c, why in skipped] == [
        (20, "step_0000000020: state.pt fails its checksum")
    ]
    with pytest.raises(CorruptCheckpoint, match=r"state\.pt fails its checksum"):
        CheckpointDir(f"s3://{bucket}/job").local_copy(f"s3://{bucket}/job/step_0000000020")
    pruned = CheckpointDir(f"s3://{bucket}/job").prune(keep=2)
    ((bad, why, where),) = pruned.set_aside
    assert bad.step == 20 and "fails its checksum" in why
    assert where.startswith(f"s3://{bucket}/job/corrupt/step_0000000020-")
    assert [c.step for c in ckpts.existing()] == [10]
    aside = where.removeprefix(f"s3://{bucket}/")
    assert s3.keys(bucket, aside) == [
        f"{aside}/{p}" for p in ("manifest.json", "sharded/__0_0.distcp", "state.pt")
    ]


def test_saving_a_step_again_replaces_it_whole(s3: S3Server, bucket: str) -> None:
    ckpts = CheckpointDir(f"s3://{bucket}/job")
    ckpts.save(10, write(b"first"))

    def only_state(d: Path) -> None:
        (d / "state.pt").write_bytes(b"second")

    ckpts.save(10, only_state)
    assert s3.keys(bucket) == ["job/step_0000000010/manifest.json", "job/step_0000000010/state.pt"]
    manifest = json.loads(
        s3.client()
        .get_object(Bucket=bucket, Key="job/step_0000000010/manifest.json")["Body"]
        .read()
    )
    assert set(manifest["files"]) == {"state.pt"}
    local = ckpts.local_copy(ckpts.path_for(10))
    assert (local / "state.pt").read_bytes() == b"second"


def test_tensorboard_files_go_to_the_bucket(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elastic.train.tensorboard import TensorBoardLog

    board = TensorBoardLog(f"s3://{bucket}/job", attempt=1, world_size=2, step=0)
    for step in (1, 2, 3):
        board.record("metrics", {"step": step, "loss": 1.0 / step})
    board.record("checkpoint_saved", {"step": 3})
    (key,) = s3.keys(bucket, "job/tensorboard/")
    assert key.endswith(".attempt1")
    board.record("metrics", {"step": 4, "loss": 0.2})
    board.close()
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / key.rsplit("/", 1)[1]).write_bytes(
        s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    )
    curves = EventAccumulator(str(tmp_path / "tb"))
    curves.Reload()
    assert [(e.step, round(e.value, 3)) for e in curves.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, 0.333),
        (4, 0.2),
    ]


def test_only_the_stores_own_variables_go_to_the_jobs() -> None:
    from jobs.isolation import storage_environment

    environ = {
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/gcp.json",
        "ETRAIN_API_TOKEN": "never",
        "AWS_SHARED_CREDENTIALS_FILE": "/home/etrain/.aws/credentials",
    }
    assert storage_environment(environ, "s3://bucket/prefix") == {
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    }
    assert storage_environment(environ, "gs://bucket/p") == {
        "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/gcp.json"
    }
    assert storage_environment(environ, "/mnt/checkpoints") == {}
