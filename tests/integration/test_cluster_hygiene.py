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


def test_a_placement_group_whose_creator_died_is_removed(ray_cluster: object) -> None:
    """As an attempt stopped while Ray Train places its worker group leaves one: the creator
    (an actor) is dead, the Ray job (here the test's driver) lives, so GCS keeps the group.
    The namespace's membership watcher removes it; the driver's own group stays."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from elastic.cluster.capacity import RayCapacity

    @ray.remote(num_cpus=0)
    class Creator:
        def create(self) -> str:
            group = placement_group([{"CPU": 1}])
            ray.get(group.ready())
            return str(group.id.hex())

    kept = placement_group([{"CPU": 1}])
    ray.get(kept.ready())
    creator = Creator.remote()  # type: ignore[attr-defined]
    orphan = ray.get(creator.create.remote())
    ray.kill(creator)

    def state(group_id: str) -> str:
        return str(ray.util.placement_group_table()[group_id]["state"])

    watcher = RayCapacity(ray.get_runtime_context().namespace, "hygiene")
    wait_for(
        lambda: (
            ray.get(watcher._get_watcher().snapshot.remote("hygiene", -1, 0)) is not None
            and state(orphan) == "REMOVED"
        ),
        30,
        what="the orphaned placement group to be removed",
    )
    assert state(kept.id.hex()) == "CREATED"
    remove_placement_group(kept)
