"""A test that leaves a job running (as one does whose assert fails before its cancel) must not
take the shared pool from the tests after it: conftest's autouse fixture ends every job."""

from __future__ import annotations

import ray

from jobs.launcher import ACTOR_PREFIX, supervisor_name
from tests.conftest import LiveServer, small_job, wait_for


def supervisors() -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(ACTOR_PREFIX)
    )


def test_a_job_left_running_by_its_test(server: LiveServer) -> None:
    client = server.client()
    job = client.post("/v1/jobs", json=small_job(max_steps=1_000_000)).json()
    wait_for(
        lambda: client.get(f"/v1/jobs/{job['id']}").json()["state"] == "running",
        120,
        what="the long job to run",
    )
    assert supervisor_name(job["id"]) in supervisors()
    # No cancel: this is what a failed assert above would have left behind.


def test_is_gone_when_the_next_test_starts(ray_cluster: object) -> None:
    """Runs after the test above (file order): its job's supervisor, workers and placement
    groups are gone, and every CPU of the pool is free."""
    assert supervisors() == []
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"] == 3
    live_groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    assert live_groups == []
