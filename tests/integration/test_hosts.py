"""Jobs on a Ray cluster whose nodes are hosts (``tests/hosts.py``): each worker node with its
own address, and a host name no other node can resolve (a Kubernetes pod's) that resolves
to 127.0.1.1 on the node itself (Debian's). The head, where supervisors and their torchft
lighthouses live, has such a name too.

On such a cluster anything advertised by host name is unreachable: the lighthouse's URL
(every in-place job failed at its start), and Gloo's own address, which it takes from the
host name (loopback, for a name that resolves to none or to 127.0.1.1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import all_events, small_job, wait_for, wait_until_ended
from tests.hosts import HostCluster, service, unavailable

NODES = 3
REASON = unavailable()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    # One cluster of hosts for the module, on one xdist worker.
    pytest.mark.xdist_group("hosts"),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostCluster]:
    cluster = HostCluster(tmp_path_factory.mktemp("hosts"))
    try:
        cluster.start(NODES)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def api(hosts: HostCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with service(hosts, tmp_path_factory.mktemp("service")) as live:
        yield live.client()


def job_on_every_host(steps: int, **spec: Any) -> dict[str, Any]:
    job = small_job(max_steps=steps)
    job["scaling"]["max_workers"] = NODES
    job.update(spec)
    return job


def test_the_cluster_page_lists_each_host_by_its_address(
    api: httpx.Client, hosts: HostCluster
) -> None:
    nodes = api.get("/v1/cluster").json()["nodes"]
    addresses = sorted(n["address"] for n in nodes if n["alive"])
    assert addresses == sorted([hosts.head_address, *(h.address for h in hosts.hosts)])


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_job_trains_across_hosts_whose_names_do_not_resolve(
    api: httpx.Client, hosts: HostCluster, mode: str
) -> None:
    """In place is the default for DDP on CPU: its replicas reach the lighthouse on the
    head, and each other's Gloo, by address. Restart mode's workers form one Gloo group
    across the hosts."""
    spec = job_on_every_host(30)
    if mode == "restart":
        spec["fault_tolerance"] = "restart"
    job = api.post("/v1/jobs", json=spec).json()
    assert job["spec"]["fault_tolerance"] == mode, job
    done = wait_until_ended(api, job["id"], 240)
    events = all_events(api, job["id"])
    failures = [e["data"] for e in events if e["kind"] in ("log", "state")]
    assert (done["state"], done["step"]) == ("succeeded", 30), failures[-5:]
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert states == ["queued", "starting", "running", "succeeded"], states
    kinds = [e["kind"] for e in events]
    assert kinds.count("attempt_started") == 1 and "worker_lost" not in kinds, kinds
    steps = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
    assert steps == list(range(1, 31)), steps
    # Every host trained: the job ran at the cluster's full size from its start.
    (started,) = [e["data"] for e in events if e["kind"] == "attempt_started"]
    assert started["world_size"] == NODES, started


def test_an_in_place_job_survives_the_loss_of_a_host(
    api: httpx.Client, hosts: HostCluster, tmp_path: Path
) -> None:
    """A host's every process SIGKILLed mid-job: the survivors on the other hosts train on
    without a restart, and the job ends with every step once."""
    job = api.post("/v1/jobs", json=job_on_every_host(400)).json()
    wait_for(
        lambda: api.get(f"/v1/jobs/{job['id']}").json()["step"] >= 40,
        timeout=240,
        what="the job to train a while on every host",
    )
    victim = hosts.hosts[-1]
    victim.kill()
    done = wait_until_ended(api, job["id"], 400)
    events = all_events(api, job["id"])
    assert (done["state"], done["step"]) == ("succeeded", 400), [
        e["data"] for e in events if e["kind"] == "state"
    ]
    kinds = [e["kind"] for e in events]
    assert kinds.count("attempt_started") == 1, kinds
    assert kinds.count("worker_lost") == 1, kinds
    steps = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
    assert steps == list(range(1, 401)), steps
