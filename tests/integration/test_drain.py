"""A drain notice (Ray's DrainNode with a deadline, what a spot preemption or a KubeRay
scale-down sends) for a node that holds one of a job's workers: the job pauses at its next
checkpoint and carries on without that node, before the deadline, redoing no step."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.conftest import ClusterPool, LiveServer, make_settings, small_job, wait_for

TERMINAL = {"succeeded", "failed", "cancelled"}
DEADLINE_S = 90


def get(api: httpx.Client, job_id: str) -> dict:
    r = api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def drain(node_id: str, deadline_ms: int) -> None:
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)  # type: ignore[attr-defined]
    accepted, why = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),  # type: ignore[attr-defined]
        "preempted by the test",
        deadline_ms,
    )
    assert accepted, why


def test_a_drained_node_is_left_at_the_next_checkpoint_with_no_step_redone(
    ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    ray_cluster.restore_pool()
    spec = small_job(max_steps=60)
    spec["scaling"] = {"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1}
    victim = ray_cluster.pool[2]
    try:
        with LiveServer(make_settings(tmp_path)) as live:
            api = live.client()
            job = api.post("/v1/jobs", json=spec).json()
            wait_for(
                lambda: (
                    (j := get(api, job["id"]))["state"] == "running"
                    and j["world_size"] == 3
                    and j["step"] >= 3
                ),
                180,
                what="training at 3 workers",
            )
            deadline_ms = int((time.time() + DEADLINE_S) * 1000)
            drain(victim.node_id, deadline_ms)

            def drained() -> dict | None:
                page = api.get(f"/v1/jobs/{job['id']}/events", params={"kind": "resized"})
                # A grow to 3 may come first: the drain's resize is the one with a reason.
                return next((e for e in page.json()["items"] if "reason" in e["data"]), None)

            resized = wait_for(drained, DEADLINE_S, what="the job to resize off the drained node")
            assert time.time() * 1000 < deadline_ms  # before the node goes
            data = resized["data"]
            assert (data["reason"], data["from_world"], data["to_world"]) == ("drain", 3, 2)
            assert data["steps_redone"] == 0
            done = wait_for(
                lambda: (j := get(api, job["id"]))["state"] in TERMINAL and j, 300, what="the end"
            )
            assert (done["state"], done["step"]) == ("succeeded", 60), done
            items = api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 5000}).json()
            kinds = [e["kind"] for e in items["items"]]
            assert "worker_lost" not in kinds and "restored" not in kinds
            assert kinds.count("attempt_started") == 2
    finally:
        ray_cluster.kill_node(victim)  # a drained node does not come back
        ray_cluster.restore_pool()
