"""Where a restart's time goes: one `restart`-mode job, one node killed, and the timeline
of what followed, in seconds from the kill.

The cluster of bench/recovery.py (a head that trains nothing and three one-CPU nodes, node
failures detected after 3 missed 1 s health checks); the same small CNN job, 80 steps, a
checkpoint every 10; the node of rank 1 killed once step 24 is seen. It prints the job's
events (state changes, attempts, the first step of each attempt, recovery figures) and the
start and end of every Ray actor of the run (the supervisor, and the job's `WarmWorker`s:
the ones placed at the start, which carry every later attempt unless they die, and any
placed later for a slot that had none), from Ray's actor table. Until the warm pool
(`elastic/restart/`) it showed a restart's serial chain of new processes: the
supervisor's `FitActor`, Ray Train's controller, its workers and its helper actors.

    .venv/bin/python -m bench.restart_profile [--startup-concurrency N]

``--startup-concurrency`` sets Ray's ``worker_maximum_startup_concurrency`` on the cluster
(Ray's own default is one process start at a time on a node with no CPUs, as the head here).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import ray
from ray._private import state as ray_state
from ray.cluster_utils import Cluster

from bench.recovery import JobEvents, job_spec, metrics_records, serve, stamp
from bench.recovery_ray import NAMESPACE, fresh_nodes, kill_and_grow
from jobs.launcher import FAST_FAILURE_DETECTION, keep_ray_on_loopback

STEPS = 80


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--startup-concurrency", type=int, default=0)
    args = parser.parse_args()
    keep_ray_on_loopback()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    system_config: dict[str, Any] = dict(FAST_FAILURE_DETECTION)
    if args.startup_concurrency:
        system_config["worker_maximum_startup_concurrency"] = args.startup_concurrency
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": system_config}
    )
    nodes: list[Any] = []
    fresh_nodes(cluster, nodes)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)

    server, thread, client = serve(tempfile.mkdtemp(prefix="etrain-profile-"))
    job_id = client.post("/v1/jobs", json=job_spec(STEPS, "restart")).json()["id"]

    events = JobEvents(client, job_id)

    def rank1_node() -> str | None:
        supervisor = ray.get_actor(f"etrain-supervisor-{job_id}", namespace=NAMESPACE)
        status: Any = ray.get(supervisor.status.remote())
        node: str | None = status["worker_nodes"].get(1)
        return node

    # No node comes back: the profile is of the restart after the kill alone.
    killed_at, _ = kill_and_grow(
        lambda: metrics_records(events()), rank1_node, cluster, nodes, lambda: True
    )
    while client.get(f"/v1/jobs/{job_id}").json()["state"] not in {
        "succeeded",
        "failed",
        "cancelled",
    }:
        time.sleep(0.2)

    print(f"seconds from the kill; startup concurrency {args.startup_concurrency or 'Ray default'}")
    print()
    print("the job's events:")
    first_step_of: set[int] = set()
    for e in events():
        kind, data = e["kind"], e["data"]
        if kind in ("log", "checkpoint_saved", "checkpoint_removed"):
            continue
        if kind == "metrics":
            if data["attempt"] in first_step_of:
                continue
            first_step_of.add(data["attempt"])
            kind = f"first step of attempt {data['attempt']}"
            data = {"step": data["step"], "world_size": data["world_size"]}
        print(f"{stamp(e) - killed_at:8.2f}  {kind}  {json.dumps(data)[:160]}")
    print()
    print("Ray's actors (start, end):")
    actors = sorted(
        ray_state.actors().values(),  # type: ignore[no-untyped-call]
        key=lambda a: float(a.get("StartTime") or 0),
    )
    for actor in actors:
        start = float(actor.get("StartTime") or 0) / 1000 - killed_at
        end = actor.get("EndTime")
        ended = f"{float(end) / 1000 - killed_at:8.2f}" if end else "       -"
        print(f"{start:8.2f} {ended}  {actor['ActorClassName']}")
    server.should_exit = True
    thread.join(timeout=30)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
