"""Checkpoints in a bucket of a real S3-compatible server on loopback, end to end: a job on
several Ray nodes keeps its checkpoints there (nothing on the local filesystem), a node
dies, and the job restores from the bucket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from elastic.job_state import TERMINAL_STATES
from tests.conftest import (
    ClusterPool,
    LiveServer,
    make_settings,
    small_job,
    wait_for,
    wait_until_ended,
)
from tests.s3_server import S3Server, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def get(api: httpx.Client, job_id: str) -> dict:
    r = api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_job_checkpoints_to_the_bucket_loses_a_node_and_restores_from_it(
    ray_cluster: ClusterPool, s3: S3Server, tmp_path: Path
) -> None:
    ray_cluster.restore_pool()
    bucket = s3.new_bucket()
    uri = f"s3://{bucket}/etrain"
    spec = small_job(max_steps=120)
    spec["scaling"] = {"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1}
    spec["fault_tolerance"] = "restart"  # the restore from the bucket is what is tested
    with LiveServer(make_settings(tmp_path, checkpoint_dir=uri)) as live:
        api = live.client()
        job = api.post("/v1/jobs", json=spec).json()
        wait_for(
            lambda: (
                (j := get(api, job["id"]))["state"] not in TERMINAL_STATES
                and j["world_size"] == 3
                and j["step"] >= 25
            ),
            180,
            what="training at 3 workers past a checkpoint",
        )
        ray_cluster.kill_node(ray_cluster.pool[1])
        done = wait_until_ended(api, job["id"], 300)
        assert done["state"] == "succeeded", done
        assert done["step"] == 120
        items = api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 5000}).json()["items"]
        (restored,) = [e["data"] for e in items if e["kind"] == "restored"]
        assert restored["checkpoint_step"] >= 20 and restored["checkpoint_step"] % 10 == 0
        listed = api.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
    # The service lists the bucket's checkpoints; the bucket holds them, the disk none.
    assert [(c["step"], c["path"]) for c in listed] == [
        (step, f"step_{step:010d}") for step in (100, 110, 120)
    ]
    keys = s3.keys(bucket, f"etrain/{job['id']}/step_")
    steps = sorted({int(k.split("/")[2].removeprefix("step_")) for k in keys})
    assert steps == [100, 110, 120]
    for step in steps:
        assert f"etrain/{job['id']}/step_{step:010d}/manifest.json" in keys
        assert f"etrain/{job['id']}/step_{step:010d}/state.pt" in keys
    # TensorBoard's files are copied there too: one per attempt (the first, the restart).
    boards = s3.keys(bucket, f"etrain/{job['id']}/tensorboard/")
    assert sorted(k.rsplit(".", 1)[1] for k in boards) == ["attempt1", "attempt2"]
    assert not (tmp_path / "checkpoints").exists()
    assert not list(tmp_path.rglob("step_*"))
