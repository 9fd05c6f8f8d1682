"""A drain notice (Ray's DrainNode with a deadline, what a spot preemption or a KubeRay
scale-down sends) for a node that holds one of a job's workers. In restart mode the job
pauses at its next step, with a checkpoint of that step (not at its next scheduled
checkpoint, which may come after the node is gone), and carries on without that node,
before the deadline, redoing no step. In place, the replica on the node leaves the quorum at
a step boundary and the others train on: no pause for a checkpoint, no new attempt.

Ray ends a drained node as soon as it is idle: here within a second of the pause, while the
supervisor still waits for the paused worker group's end (which may fail with the node)."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from elastic.job_state import TERMINAL_STATES
from tests.conftest import (
    POOL_SIZE,
    TOKEN,
    ClusterPool,
    LiveServer,
    all_events,
    make_settings,
    small_job,
    wait_for,
)

# A drain is timed here against Ray's deadline: the machine to itself (tests/conftest.py).
pytestmark = pytest.mark.alone

# The drain's deadline: what a spot notice gives (2 min on AWS, 30 s on GCP) is beyond the
# pause and restart here, so the job must be off the node well before it.
DEADLINE_S = 120
# Far apart, so that a pause at the next scheduled checkpoint would come long after the
# notice: the drain must not wait for it.
EVERY_STEPS = 200
# The shortest notice a cloud gives (GCP's preemption): the job is off the node within it,
# timed from the notice to the resize's event.
SHORTEST_NOTICE_S = 30


def get(api: httpx.Client, job_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    job: dict[str, Any] = r.json()
    assert job["state"] not in TERMINAL_STATES, job  # only the test ends it
    return job


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def workers_of(api: httpx.Client, job_id: str) -> dict[str, str]:
    """rank -> node id of the job's live attempt, as GET /v1/cluster tells its owner."""
    (job,) = [j for j in api.get("/v1/cluster").json()["jobs"] if j["id"] == job_id]
    workers: dict[str, str] = job["workers"]
    return workers


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


def long_job_over_the_pool(**top: Any) -> dict[str, Any]:
    """A job that runs until the test cancels it, on up to every pool node, with its
    scheduled checkpoints far apart."""
    spec = small_job(max_steps=1_000_000)
    spec["scaling"] = {"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1}
    spec["checkpoint"] = {"every_steps": EVERY_STEPS, "keep": 2}
    spec.update(top)
    return spec


def test_a_drained_node_is_left_at_the_next_step_with_no_step_redone(
    ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    import ray

    ray_cluster.restore_pool()
    # Exactly the pool's nodes take workers: a drained one leaves room for 2, not 3.
    assert sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()) == POOL_SIZE
    spec = long_job_over_the_pool(fault_tolerance="restart")
    victim = None
    try:
        with LiveServer(make_settings(tmp_path)) as live:
            api = live.client()
            job = api.post("/v1/jobs", json=spec).json()
            jid = job["id"]
            wait_for(
                lambda: (
                    (j := get(api, jid))["state"] == "running"
                    and j["world_size"] == 3
                    and len(workers_of(api, jid)) == 3
                ),
                180,
                interval=0.2,
                what="training at 3 workers",
            )
            node_id = workers_of(api, jid)["1"]
            (victim,) = [n for n in ray_cluster.pool if n.node_id == node_id]
            # Early in a checkpoint interval: the next scheduled one is far ahead.
            at_notice = wait_for(
                lambda: 5 <= (step := get(api, jid)["step"]) % EVERY_STEPS <= 60 and step,
                180,
                interval=0.1,
                what="a step early in a checkpoint interval",
            )
            deadline_ms = int((time.time() + DEADLINE_S) * 1000)
            drained_at = time.time()
            drain(node_id, deadline_ms)

            def drained() -> dict[str, Any] | None:
                get(api, jid)
                page = api.get(f"/v1/jobs/{jid}/events", params={"kind": "resized"})
                # A grow to 3 may come first: the drain's resize is the one with a reason.
                return next((e for e in page.json()["items"] if "reason" in e["data"]), None)

            try:
                resized = wait_for(drained, DEADLINE_S - 10, what="the resize off the node")
            except AssertionError as e:
                timeline = [(x["time"], x["kind"], x["data"]) for x in all_events(api, jid)]
                raise AssertionError(f"{e}; the job's events: {timeline[-40:]}") from None
            assert stamp(resized) - drained_at < SHORTEST_NOTICE_S, resized
            data = resized["data"]
            assert (data["reason"], data["from_world"], data["to_world"]) == ("drain", 3, 2)
            assert data["steps_redone"] == 0, data
            resumed = data["checkpoint_step"]
            # It paused at the step it was at when it heard, not at the next multiple of
            # EVERY_STEPS.
            assert at_notice <= resumed < (at_notice // EVERY_STEPS + 1) * EVERY_STEPS, (
                at_notice,
                resumed,
            )
            after = wait_for(
                lambda: (j := get(api, jid))["step"] > resumed + 2 and j, 60, what="training on"
            )
            assert after["world_size"] == 2, after
            placed = workers_of(api, jid)
            assert sorted(placed) == ["0", "1"] and node_id not in placed.values(), placed
            seen = all_events(api, jid)
            kinds = [e["kind"] for e in seen]
            assert "worker_lost" not in kinds and "restored" not in kinds, kinds
            # One attempt after the drain, from the checkpoint it paused at (a grow to 3
            # may have made one more before it).
            started = [e["data"] for e in seen if e["kind"] == "attempt_started"]
            assert started[-1] == {
                "attempt": len(started),
                "world_size": 2,
                "checkpoint_step": resumed,
            }
            assert [d["world_size"] for d in started[:-1]][-1:] == [3], started
            (saved,) = [
                e for e in seen if e["kind"] == "checkpoint_saved" and e["data"]["step"] == resumed
            ]
            first_at_2 = next(
                e for e in seen if e["kind"] == "metrics" and e["data"]["world_size"] == 2
            )
            print(
                f"drain at step {at_notice}; paused at step {resumed}, its checkpoint published "
                f"{stamp(saved) - drained_at:.1f} s after the drain; first step at 2 workers "
                f"{stamp(first_at_2) - drained_at:.1f} s after it"
            )
            assert api.post(f"/v1/jobs/{jid}/cancel").json()["state"] == "cancelled"
    finally:
        if victim is not None and victim in ray_cluster.pool:
            ray_cluster.kill_node(victim)  # a drained node does not come back
        ray_cluster.restore_pool()


def package_loop_over_the_pool() -> dict[str, Any]:
    """The package's script-style loop (tests/workloads/package_loop/script.py), in place,
    for as long as the test lets it run."""
    spec = long_job_over_the_pool(
        entrypoint="script.py:main",
        hyperparameters={"args": ["--epochs", "100000", "--pace", "0.02"]},
        fault_tolerance="in_place",
    )
    del spec["workload"]
    return spec


@pytest.mark.parametrize("loop", ["built-in", "package"])
def test_in_place_a_drained_node_s_replica_leaves_and_the_others_train_on(
    ray_cluster: ClusterPool, tmp_path: Path, loop: str
) -> None:
    """A built-in loop, or a package's loop run by a confined child of each replica (the
    actor passes the drain down to it)."""
    import ray

    from elastic_train import Client
    from tests.integration.test_package_loops import LOOP_DIR

    ray_cluster.restore_pool()
    assert sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()) == POOL_SIZE
    spec = long_job_over_the_pool() if loop == "built-in" else package_loop_over_the_pool()
    victim = None
    try:
        with LiveServer(make_settings(tmp_path)) as live:
            api = live.client()
            if loop == "built-in":
                job = api.post("/v1/jobs", json=spec).json()
            else:
                with Client(live.url, TOKEN) as client:
                    job = api.get(f"/v1/jobs/{client.submit(spec, code=LOOP_DIR).id}").json()
            jid = job["id"]
            assert job["spec"]["fault_tolerance"] == "in_place"  # the default for this job
            wait_for(
                lambda: (
                    (j := get(api, jid))["state"] == "running"
                    and j["world_size"] == 3
                    and len(workers_of(api, jid)) == 3
                    and j["step"] >= 10
                ),
                180,
                interval=0.2,
                what="training at 3 replicas",
            )
            node_id = workers_of(api, jid)["1"]
            (victim,) = [n for n in ray_cluster.pool if n.node_id == node_id]
            deadline_ms = int((time.time() + DEADLINE_S) * 1000)
            at_notice = get(api, jid)["step"]
            drained_at = time.time()
            drain(node_id, deadline_ms)

            def drained() -> dict[str, Any] | None:
                get(api, jid)
                page = api.get(f"/v1/jobs/{jid}/events", params={"kind": "resized"})
                return next((e for e in page.json()["items"] if "reason" in e["data"]), None)

            resized = wait_for(drained, 60, what="the resize off the draining node")
            assert stamp(resized) - drained_at < SHORTEST_NOTICE_S, resized
            data = resized["data"]
            assert (data["reason"], data["from_world"], data["to_world"]) == ("drain", 3, 2)
            assert data["steps_redone"] == 0, data
            assert data["in_place"] is True
            # The others waited only for the lighthouse to forget the replica that left.
            assert data["pause_seconds"] < 1.0, data
            assert data["step"] > at_notice
            after = wait_for(
                lambda: (j := get(api, jid))["step"] > data["step"] + 10 and j,
                60,
                what="training on at 2",
            )
            assert after["world_size"] == 2, after
            assert node_id not in workers_of(api, jid).values()
            seen = all_events(api, jid)
            kinds = [e["kind"] for e in seen]
            # No loss, no restart, no checkpoint to pause at: the same attempt trains on.
            assert "worker_lost" not in kinds and "restored" not in kinds, kinds
            assert kinds.count("attempt_started") == 1, kinds
            saved = [e["data"]["step"] for e in seen if e["kind"] == "checkpoint_saved"]
            assert all(step % EVERY_STEPS == 0 for step in saved), saved  # none off schedule
            assert api.post(f"/v1/jobs/{jid}/cancel").json()["state"] == "cancelled"
    finally:
        if victim is not None and victim in ray_cluster.pool:
            ray_cluster.kill_node(victim)  # a drained node does not come back
        ray_cluster.restore_pool()
