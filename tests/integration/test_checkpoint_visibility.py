"""A checkpoint directory that some node does not share fails the job at its start, with a
message naming the setting; a shared one passes the same check unnoticed.

The test cluster's nodes all share this machine's filesystem, so the unshared node is made
for real: a Ray node started in its own mount namespace with an empty tmpfs over the
checkpoint directory, as a node whose "/mnt/checkpoints" is its own local disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    POOL_SIZE,
    ClusterPool,
    LiveServer,
    make_settings,
    small_job,
    state_address,
    wait_for,
    wait_until_ended,
)

# One more node of the test cluster, as ray.cluster_utils.Cluster.add_node starts one (`ray
# start` refuses to join a cluster kept on loopback), ended with its processes on SIGTERM.
NODE = """
import signal, sys, time
import ray._private.node, ray._private.parameter
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
params = ray._private.parameter.RayParams(
    gcs_address=sys.argv[1], num_cpus=1, num_gpus=0, object_store_memory=150 * 1024 * 1024,
    min_worker_port=0, max_worker_port=0, include_log_monitor=False, node_manager_port=0,
)
params.dashboard_agent_listen_port = None
node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
while True:
    time.sleep(1)
"""


def get(api: httpx.Client, job_id: str) -> dict:
    r = api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "none", "/mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.fixture
def node_with_its_own_dir(ray_cluster: ClusterPool, tmp_path: Path) -> Iterator[Path]:
    """A one-CPU Ray node that sees an empty directory of its own at the returned path."""
    if not can_unshare():
        pytest.skip("needs mount namespaces (root, or unshare permitted) to make a node-local dir")
    import ray

    ray_cluster.restore_pool()  # first: the pool's own wait counts only the nodes it made
    root = tmp_path / "checkpoints"
    root.mkdir()
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    script = (
        f'mount -t tmpfs none {root} && exec {sys.executable} -c "$0" {ray_cluster.cluster.address}'
    )
    log = tmp_path / "node.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, NODE],
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(
            lambda: (
                {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
                or (proc.poll() is not None and pytest.fail(log.read_text()))
            ),
            90,
            what="the node with its own checkpoint directory to join",
        )
        yield root
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        extra = lambda: {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before  # noqa: E731
        wait_for(lambda: not extra(), 60, what="the extra node to leave the cluster")


def test_a_directory_one_node_does_not_share_fails_the_job_naming_the_setting(
    ray_cluster: ClusterPool, node_with_its_own_dir: Path, tmp_path: Path
) -> None:
    root = node_with_its_own_dir
    with LiveServer(make_settings(tmp_path, checkpoint_dir=str(root))) as live:
        api = live.client()
        job = api.post("/v1/jobs", json=small_job(max_steps=20)).json()
        done = wait_until_ended(api, job["id"], 120)
        assert done["state"] == "failed", done
        items = api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["items"]
        assert [e for e in items if e["kind"] == "attempt_started"] == []
        (failed,) = [
            e["data"] for e in items if e["kind"] == "state" and e["data"]["state"] == "failed"
        ]
        reason = failed["reason"]
        assert reason.startswith(f"the checkpoint directory {root / job['id']} is not shared")
        assert "cannot read a file the supervisor wrote there" in reason
        assert "ETRAIN_CHECKPOINT_DIR" in reason
        # One node failed the probe: the three pool nodes share the directory.
        assert reason.count("node 127.0.0.1") == 1, reason
    assert list((root / job["id"]).iterdir()) == []  # no probe file left behind


def probes_run() -> int:
    """How many probe tasks the cluster has run (Ray reports a task's events to its state
    API within about a second)."""
    from ray.util.state import list_tasks

    tasks = list_tasks(
        address=state_address(), filters=[("name", "=", "probe_from_node")], limit=10_000
    )
    return len({t["task_id"] for t in tasks})


def test_a_shared_directory_passes_and_the_job_succeeds_and_is_probed_once_per_node(
    ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    """The pool's three nodes answer the first job's probe; the next job on the same
    checkpoint directory starts without probing them again (each probe starts a process)."""
    ray_cluster.restore_pool()
    root = tmp_path / "checkpoints"
    before = probes_run()
    with LiveServer(make_settings(tmp_path, checkpoint_dir=str(root))) as live:
        api = live.client()

        def run_job() -> dict:
            job = api.post("/v1/jobs", json=small_job(max_steps=20)).json()
            done = wait_until_ended(api, job["id"], 180)
            assert done["state"] == "succeeded", done
            assert done["step"] == 20
            return job

        jobs = [run_job()]
        wait_for(lambda: probes_run() - before >= POOL_SIZE, 15, what="the probes")
        assert probes_run() - before == POOL_SIZE
        jobs.append(run_job())
        # A probe runs before the job's first step: the second job's would have been
        # reported seconds before it ended.
        time.sleep(1.5)
        assert probes_run() - before == POOL_SIZE
    for job in jobs:
        left = [p.name for p in (root / job["id"]).iterdir() if p.name.startswith(".")]
        assert left == []
