"""Jobs on a Ray cluster whose nodes are hosts (``tests/hosts.py``): each worker node with its
own address, and a host name no other node can resolve (a Kubernetes pod's) that resolves
to 127.0.1.1 on the node itself (Debian's). The head, where supervisors and their torchft
lighthouses live, has such a name too.

On such a cluster anything advertised by host name is unreachable: the lighthouse's URL
(every in-place job failed at its start), and Gloo's own address, which it takes from the
host name (loopback, for a name that resolves to none or to 127.0.1.1)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from elastic.job_state import TERMINAL_STATES
from elastic.warm_processes import SCHEDULER_NAME
from tests.conftest import (
    MachineShare,
    all_events,
    longest_pause_after,
    small_job,
    wait_for,
    wait_until_ended,
)
from tests.gcs import NO_REDIS, program_in, redis_answers
from tests.hosts import Host, HostCluster, pids_in, service, unavailable
from tests.integration.test_elastic import (
    BATCH,
    DATASET,
    assert_every_sample_once,
    elastic_job,
    final_state,
)
from tests.integration.test_in_place import committed_samples
from tests.processes import named, ready_to_train
from tests.workloads import thread_probe

NODES = 3
REASON = unavailable()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    # One cluster of hosts for the module, on one xdist worker.
    pytest.mark.xdist_group("hosts"),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostCluster]:
    # The head keeps its GCS's state in Redis where there is one, as KubeRay's GCS fault
    # tolerance has it: the head's loss is one of the faults.
    namespace = f"etrain-hosts-{uuid.uuid4().hex[:12]}" if redis_answers() else None
    cluster = HostCluster(tmp_path_factory.mktemp("hosts"), redis_namespace=namespace)
    try:
        cluster.start(NODES)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def service_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="module")
def api(hosts: HostCluster, service_dir: Path) -> Iterator[httpx.Client]:
    with service(hosts, service_dir) as client:
        yield client


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


# What a job's worker process is titled after, by mode (Ray titles a process after its actor).
WORKER_TITLE = {"in_place": b"ray::Replica", "restart": b"ray::WarmWorker"}


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_jobs_workers_start_in_the_processes_their_hosts_kept_ready(
    hosts: HostCluster, tmp_path: Path, mode: str
) -> None:
    """Each host (one CPU) keeps a process ready to train, started by its raylet at the
    scheduler's call to the host's own address (elastic/warm_processes.py). A job on every
    host runs its workers in exactly those processes, and once it is over, each host's pool
    is filled again with new ones: a process that served a job serves no other. A service of
    its own, with a scheduler of its own (its Ray namespace, one per test: a scheduler
    remembers in Ray's store which nodes it filled), keeps them. Each worker computes with
    one thread, its host's one CPU, although its process imported torch before Ray said how
    many CPUs it has."""
    hosts.restore(NODES)
    namespace = f"etrain-ready-{mode}"
    ready = {
        "ETRAIN_WARM_PROCESSES_PER_NODE": "2",
        "ETRAIN_RAY_NAMESPACE": namespace,
        "ETRAIN_ENTRYPOINT_MODULES": json.dumps(["tests.workloads"]),
    }
    try:
        with service(hosts, tmp_path, ready) as api:
            _workers_start_in_ready_processes(api, hosts, mode)
    finally:
        _pools_gone(hosts, namespace)


def _pools_gone(hosts: HostCluster, namespace: str) -> None:
    """The pools' scheduler (detached: it outlives its service) and its ready processes
    gone. Left, it would fill the pool of every host the module's later tests add back,
    importing torch beside their timed recoveries."""
    assert hosts.kill_actor(SCHEDULER_NAME, namespace)
    for host in hosts.alive():
        for pid in ready_to_train(pids_in(host.netns)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _workers_start_in_ready_processes(api: httpx.Client, hosts: HostCluster, mode: str) -> None:
    alive = hosts.alive()

    def pools() -> dict[str, set[int]] | None:
        found = {h.netns: ready_to_train(pids_in(h.netns)) for h in alive}
        return found if all(len(p) == 1 for p in found.values()) else None

    before = wait_for(pools, 180, what="a process ready to train on every host")
    spec = job_on_every_host(30, fault_tolerance=mode, workload=thread_probe.ENTRYPOINT)
    job = api.post("/v1/jobs", json=spec).json()
    workers: dict[str, set[int]] = {h.netns: set() for h in alive}
    while (state := api.get(f"/v1/jobs/{job['id']}").json())["state"] not in TERMINAL_STATES:
        for h in alive:
            workers[h.netns] |= named(pids_in(h.netns), WORKER_TITLE[mode])
        time.sleep(0.2)
    assert state["state"] == "succeeded", state
    assert workers == before
    lines = [i["line"] for i in api.get(f"/v1/jobs/{job['id']}/logs").json()["items"]]
    threads = [
        json.loads(ln[len(thread_probe.MARKER) :])
        for ln in lines
        if ln.startswith(thread_probe.MARKER)
    ]
    assert threads == [{"torch": 1, "cpus": "1"}] * len(alive), threads
    after = wait_for(pools, 180, what="every host's pool filled again")
    assert all(after[netns].isdisjoint(before[netns]) for netns in after), (before, after)


# From the kill to the next step, on the machine alone (the other xdist worker's tests wait).
# The goals are 0.5 s in place and 2 s in restart mode. In place it is under 1 s here; the
# bound leaves room for a loaded 2-core machine. Restart mode is about 0.6 s on the quiet
# machine (docs/benchmarks.md): a survivor that fails shuts its process group's sockets, so
# the others fail at once too, and the dead worker's node refuses a handshake with its
# raylet. A survivor left blocked would be killed at the 5 s settle bound and replaced by a
# new process, which imports torch: the bound catches that too.
PAUSE_BOUND_S = {"in_place": 1.5, "restart": 5.0}
STEPS = 300


def kill_mid_job(
    api: httpx.Client,
    hosts: HostCluster,
    machine_share: MachineShare,
    mode: str,
    kill: Callable[[list[Host]], float],
) -> tuple[list[dict[str, Any]], float]:
    """A job on every host, through ``kill`` (given the live hosts, it returns the time of
    its first kill) mid-job: the job ends ``succeeded`` with every step reported, in order
    (a step a loss interrupted is reported again once trained). Its events, and the kill's
    time."""
    hosts.restore(NODES)
    spec = job_on_every_host(STEPS, fault_tolerance=mode)
    # Alone from the submission to the job's end: on 2 cores, beside the rest of the suite
    # and five Ray nodes, a starved survivor's heartbeats can stop for the in-place fence's
    # 0.3 s (a false loss that README "Known limits" describes; it was seen here once). Taken
    # before the job starts: waiting for the other worker's test after it, the job once
    # trained to its end before the kill.
    with machine_share.alone():
        job = api.post("/v1/jobs", json=spec).json()
        wait_for(
            lambda: api.get(f"/v1/jobs/{job['id']}").json()["step"] >= 40,
            timeout=240,
            what="the job to train a while on every host",
        )
        at_kill = api.get(f"/v1/jobs/{job['id']}").json()
        killed_at = kill(hosts.alive())
        done = wait_until_ended(api, job["id"], 400)
    assert at_kill["state"] == "running" and at_kill["step"] < STEPS - 100, at_kill
    events = all_events(api, job["id"])
    states = [e["data"] for e in events if e["kind"] == "state"]
    assert (done["state"], done["step"]) == ("succeeded", STEPS), states
    reported = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
    assert sorted(set(reported)) == list(range(1, STEPS + 1)), reported
    return events, killed_at


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_job_survives_the_loss_of_a_host(
    api: httpx.Client, hosts: HostCluster, machine_share: MachineShare, mode: str
) -> None:
    """A host's every process SIGKILLed mid-job. In place, the survivors on the other
    hosts train on in the same attempt; in restart mode, the surviving warm workers resume
    from the latest checkpoint. The job ends with every step counted once."""
    events, killed_at = kill_mid_job(
        api, hosts, machine_share, mode, lambda alive: alive[-1].kill()
    )
    # In place the attempt goes on at 2; restart mode starts a second attempt at 2.
    sizes = [e["data"]["world_size"] for e in events if e["kind"] == "attempt_started"]
    assert sizes == ([NODES] if mode == "in_place" else [NODES, NODES - 1]), sizes
    losses = [e["data"] for e in events if e["kind"] == "worker_lost"]
    lost = losses[0]
    assert lost["from_world"] == NODES, losses
    if mode == "restart":
        assert len(losses) == 1, losses
    metrics = [e for e in events if e["kind"] == "metrics"]
    # The stall that spans the kill, and any that starts within 3 s of it.
    assert longest_pause_after(killed_at, metrics, 3.0) <= PAUSE_BOUND_S[mode], lost


# Two hosts of one rack lost 0.3 s apart, from the first kill to the next step. The goal is
# 2 s in both modes (docs/benchmarks.md has the figures on a quiet machine). A late survivor
# can fail one more rendezvous try on a loaded 2-core machine; the bound leaves room for
# that, and catches the collective timeout's 30 s. In restart mode the second host's
# worker answers the first pings and dies after them: its next ping finds it.
APART_S = 0.3
TWO_PAUSE_BOUND_S = 3.5


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_job_survives_two_hosts_lost_a_moment_apart(
    api: httpx.Client, hosts: HostCluster, machine_share: MachineShare, mode: str
) -> None:
    """Two hosts' every process SIGKILLed 0.3 s apart mid-job: the last worker trains on
    (in place, in the same attempt; in restart mode, in one more attempt from the latest
    checkpoint), within the bound, and the job ends with every step counted once."""

    def two_apart(alive: list[Host]) -> float:
        first, second = alive[-2:]
        killed_at = first.kill()
        time.sleep(max(0.0, killed_at + APART_S - time.time()))
        second.kill()
        return killed_at

    events, killed_at = kill_mid_job(api, hosts, machine_share, mode, two_apart)
    sizes = [e["data"]["world_size"] for e in events if e["kind"] == "attempt_started"]
    # In restart mode the second loss falls before the next attempt or in its start,
    # whichever comes first on the day: both are one loss, counted once.
    assert sizes in ([[NODES]] if mode == "in_place" else [[NODES, 1], [NODES, 2, 1]]), sizes
    losses = [e["data"] for e in events if e["kind"] == "worker_lost"]
    # A rank is the attempt's; a node is the cluster's, whichever attempt lost it.
    lost = [r for x in losses for r in (x["replicas"] if mode == "in_place" else x["nodes"])]
    assert len(lost) == len(set(lost)) == 2 and losses[0]["from_world"] == NODES, losses
    metrics = [e for e in events if e["kind"] == "metrics"]
    print(f"{mode}, two hosts 0.3 s apart:", longest_pause_after(killed_at, metrics, 3.0))
    assert longest_pause_after(killed_at, metrics, 3.0) <= TWO_PAUSE_BOUND_S, losses


# The job the cut-off hosts are tested under: float64, every sample of every epoch recorded,
# so that its end can be compared with an uninterrupted run's.
CUT_STEPS = 160
# From the cut to the next step. In place a cut-off replica is dropped by the lighthouse
# after its heartbeat timeout (0.3 s) and the survivors' step in flight is aborted and redone
# (elastic/in_place/abort.py): the goal is the heartbeat timeout + 0.5 s; the bound leaves
# room for a loaded 2-core machine. In restart mode the survivors' collective hangs (packets
# are dropped, not refused) until Ray declares the node dead (about 6 s: each of 3 missed
# health checks waits out its 1 s timeout); then the attempt stops and its survivors are
# told to abandon it, shut their group's sockets and resume warm from the latest checkpoint:
# 5.8-6.7 s in the restart soak (16.5 s before the abandon, when they were killed after 3 s
# and replaced). The bound was kept from then.
CUT_PAUSE_BOUND_S = {"in_place": 1.5, "restart": 30.0}
_uninterrupted: dict[str, torch.Tensor] = {}


def exact_job(steps: int = CUT_STEPS, **spec: Any) -> dict[str, Any]:
    job = elastic_job(steps, every=20, **spec)
    job["hyperparameters"]["augment"] = "crop_flip"
    return job


def uninterrupted(api: httpx.Client, root: Path) -> dict[str, torch.Tensor]:
    """The same job on the same hosts with no fault (classic DDP), made once."""
    if not _uninterrupted:
        job = api.post("/v1/jobs", json=exact_job()).json()
        assert wait_until_ended(api, job["id"], 400)["state"] == "succeeded"
        _uninterrupted.update(final_state(api, job["id"], root))
    return _uninterrupted


def cut(host: Host, fault: str) -> float:
    if fault == "freeze":
        return host.freeze()
    return host.partition(one_way=fault == "one-way partition")


def mend(host: Host, fault: str) -> None:
    if fault == "freeze":
        host.thaw()
    else:
        host.heal()


@pytest.mark.parametrize(
    ("mode", "fault"),
    [
        ("in_place", "partition"),
        ("in_place", "one-way partition"),
        ("in_place", "freeze"),
        ("restart", "partition"),
        ("restart", "one-way partition"),
        ("restart", "freeze"),
    ],
)
def test_a_host_cut_off_then_back_never_splits_the_job(
    api: httpx.Client,
    hosts: HostCluster,
    machine_share: MachineShare,
    service_dir: Path,
    mode: str,
    fault: str,
) -> None:
    """A host is cut from its peers (both ways; one way, where it hears them and they do not
    hear it; or frozen whole) mid-job, and mended 10 s later. The others train on without it;
    it never commits a step alone (no split brain: every replica that committed a step
    committed the same samples, each sample once per epoch); Ray has declared its node dead
    by then, so it stays out. The job ends on the uninterrupted run's float64 model."""
    root = service_dir / "checkpoints"
    hosts.restore(NODES)
    reference = uninterrupted(api, root)
    with machine_share.alone():
        job = api.post("/v1/jobs", json=exact_job(fault_tolerance=mode)).json()
        wait_for(
            lambda: (
                (j := api.get(f"/v1/jobs/{job['id']}").json())["step"] >= 30
                and j["world_size"] == NODES
            ),
            timeout=240,
            what="the job training on every host",
        )
        host = hosts.alive()[-1]
        cut_at = cut(host, fault)
        try:
            wait_for(
                lambda: (
                    (j := api.get(f"/v1/jobs/{job['id']}").json())["world_size"] == NODES - 1
                    and j["state"] == "running"
                ),
                timeout=120,
                what=f"the job on the other hosts after the {fault}",
            )
            time.sleep(max(0.0, cut_at + 10 - time.time()))
        finally:
            mend(host, fault)
        done = wait_until_ended(api, job["id"], 400)
    # A node Ray declared dead does not come back: gone for the next test.
    host.kill()
    events = all_events(api, job["id"])
    states = [e["data"] for e in events if e["kind"] == "state"]
    assert (done["state"], done["step"]) == ("succeeded", CUT_STEPS), states
    sizes = [e["data"]["world_size"] for e in events if e["kind"] == "attempt_started"]
    assert sizes == ([NODES] if mode == "in_place" else [NODES, NODES - 1]), sizes
    losses = [e["data"] for e in events if e["kind"] == "worker_lost"]
    assert losses and losses[0]["from_world"] == NODES, losses
    metrics = [e for e in events if e["kind"] == "metrics"]
    pause = longest_pause_after(cut_at, metrics, 3.0)
    print(f"{mode}, {fault}: {pause:.2f} s from the cut to the next step")
    assert pause <= CUT_PAUSE_BOUND_S[mode], (pause, losses)
    assert_exact(api, root, job["id"], mode, reference)


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_job_trains_on_through_the_loss_of_the_heads_gcs(
    api: httpx.Client,
    hosts: HostCluster,
    machine_share: MachineShare,
    service_dir: Path,
    mode: str,
) -> None:
    """The head's GCS is SIGKILLed mid-job and started again 10 s later (its state is in
    Redis). Nothing a job needs between steps goes through the GCS: the replicas or workers
    on the hosts train on while it is down, and the job ends in its one attempt, with no
    loss seen and every step once, on the uninterrupted run's float64 model."""
    if hosts.redis_namespace is None:
        pytest.skip(NO_REDIS)
    root = service_dir / "checkpoints"
    hosts.restore(NODES)
    reference = uninterrupted(api, root)
    with machine_share.alone():
        job = api.post("/v1/jobs", json=exact_job(fault_tolerance=mode)).json()
        at = wait_for(
            lambda: (
                (j := api.get(f"/v1/jobs/{job['id']}").json())["step"] >= 30
                and j["world_size"] == NODES
                and j
            ),
            timeout=240,
            what="the job training on every host",
        )
        start_gcs = hosts.kill_gcs()
        killed_at = time.time()
        try:
            wait_for(
                lambda: api.get(f"/v1/jobs/{job['id']}").json()["step"] >= at["step"] + 20,
                timeout=40,
                what="the job to train on while the GCS is down",
            )
            time.sleep(max(0.0, killed_at + 10 - time.time()))
        finally:
            new_gcs = start_gcs()
        done = wait_until_ended(api, job["id"], 400)
    events = all_events(api, job["id"])
    states = [e["data"] for e in events if e["kind"] == "state"]
    assert (done["state"], done["step"]) == ("succeeded", CUT_STEPS), states
    assert program_in(hosts.head_sessions, "gcs_server") == new_gcs  # the one started again
    assert [s["state"] for s in states] == ["queued", "starting", "running", "succeeded"]
    sizes = [e["data"]["world_size"] for e in events if e["kind"] == "attempt_started"]
    assert sizes == [NODES], sizes
    kinds = [e["kind"] for e in events]
    assert not {"worker_lost", "resized", "restored", "supervisor_recreated"} & set(kinds), [
        e["data"] for e in events if e["kind"] in ("worker_lost", "resized", "restored")
    ]
    steps = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
    assert steps == list(range(1, CUT_STEPS + 1)), steps
    metrics = [e for e in events if e["kind"] == "metrics"]
    print(f"{mode}, the GCS killed: {longest_pause_after(killed_at, metrics, 3.0):.2f} s")
    # The restarted GCS knows every host again, alive.
    assert wait_for(lambda: len(hosts.node_ids()) == NODES, 60, what="the hosts listed")
    assert_exact(api, root, job["id"], mode, reference)


def assert_exact(
    api: httpx.Client, root: Path, job_id: str, mode: str, reference: dict[str, torch.Tensor]
) -> None:
    """Every sample of every epoch trained once, and the final float64 parameters and
    momentum buffers those of the uninterrupted run."""
    assert_samples_once(root / job_id, CUT_STEPS, mode)
    ours = final_state(api, job_id, root)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert tensor.dtype == torch.float64
        torch.testing.assert_close(ours[name], tensor, rtol=1e-10, atol=1e-12, msg=name)


# A flaky link: 2 % of one host's packets lost each way, for the whole job.
LOSSY_PERCENT = 2


@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_lossy_host_is_never_taken_for_a_lost_one(
    api: httpx.Client,
    hosts: HostCluster,
    machine_share: MachineShare,
    service_dir: Path,
    mode: str,
) -> None:
    """One host drops 2 % of its packets each way from before the job starts to its end.
    TCP's retransmits delay its heartbeats, Ray's health checks and its collectives (by
    200 ms and more for a lost retransmit), but none of that is a loss: no replica is
    dropped or fenced, the job trains in one attempt at full size, and ends on the
    uninterrupted run's float64 model."""
    root = service_dir / "checkpoints"
    hosts.restore(NODES)
    reference = uninterrupted(api, root)
    host = hosts.alive()[-1]
    with machine_share.alone():
        host.degrade(LOSSY_PERCENT)
        try:
            job = api.post("/v1/jobs", json=exact_job(fault_tolerance=mode)).json()
            done = wait_until_ended(api, job["id"], 600)
        finally:
            host.heal()
    events = all_events(api, job["id"])
    states = [e["data"] for e in events if e["kind"] == "state"]
    assert (done["state"], done["step"]) == ("succeeded", CUT_STEPS), states
    sizes = [e["data"]["world_size"] for e in events if e["kind"] == "attempt_started"]
    assert sizes == [NODES], sizes
    kinds = [e["kind"] for e in events]
    assert "worker_lost" not in kinds and "resized" not in kinds, json.dumps(
        [e["data"] for e in events if e["kind"] in ("worker_lost", "joined", "resized")]
    )
    assert_exact(api, root, job["id"], mode, reference)


def assert_samples_once(job_root: Path, steps: int, mode: str) -> None:
    """Every sample of every epoch the job's ``steps`` covered went into the model once."""
    if mode == "in_place":
        # Every replica's record of a committed step agrees (committed_samples checks).
        counted = committed_samples(job_root)
        assert set(counted.values()) == {1}, "a sample trained twice"
        assert len(counted) == steps * BATCH - (steps // 16) * (16 * BATCH - DATASET)
    else:
        assert_every_sample_once(job_root, steps)


USER_CODE = Path(__file__).parents[1] / "workloads"


@pytest.mark.parametrize("style", ["command", "loop"])
def test_a_users_own_code_trains_across_hosts_whose_names_do_not_resolve(
    api: httpx.Client, hosts: HostCluster, style: str
) -> None:
    """A user's process is a child of its worker, with no Ray of its own: its process group
    must still find its peers by address (the worker's Gloo interface, passed on), not by a
    host name that resolves to 127.0.1.1 on its own host."""
    from elastic_train.code_archive import pack

    package = pack(USER_CODE / ("torchrun_script" if style == "command" else "package_loop"))
    r = api.post("/v1/code", content=package.data, headers={"Content-Type": "application/gzip"})
    assert r.status_code in (200, 201), r.text
    spec: dict[str, Any] = {
        "name": f"own-{style}",
        "code": r.json()["id"],
        "scaling": {"min_workers": 1, "max_workers": NODES, "cpus_per_worker": 1},
    }
    if style == "command":
        spec["command"] = ["python", "train.py", "--steps", "12"]
    else:
        spec["entrypoint"] = "train.py:train_loop"
        spec["hyperparameters"] = {"steps": 12}
    job = api.post("/v1/jobs", json=spec).json()
    assert "id" in job, job
    done = wait_until_ended(api, job["id"], 240)
    events = all_events(api, job["id"])
    lines = [line[2] for e in events if e["kind"] == "log" for line in e["data"]["lines"]]
    assert (done["state"], done["step"]) == ("succeeded", 12), lines[-20:]
    (started,) = [e["data"] for e in events if e["kind"] == "attempt_started"]
    assert started["world_size"] == NODES, started
    steps = [e["data"]["step"] for e in events if e["kind"] == "metrics" and "loss" in e["data"]]
    assert steps == list(range(1, 13)), steps
