"""Shared test fixtures: one real Ray cluster per session, real servers on loopback.

`make test` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``); a
plain ``pytest`` runs it serially, in the files' order. Under xdist every test that uses
the shared cluster runs on one worker, in order (the pool is one set of nodes that tests
kill and add back): first the modules whose jobs mostly wait (paced steps), then the rest,
with the ``alone`` tests last. The other worker takes the rest of the suite: first the
tests that start a Ray or a service of their own, then the unit tests. Tests marked
``alone`` (and timed parts of tests, ``machine_share.alone()``) bound a pause or a
shutdown: while one runs, the other worker's tests wait, so that it has the machine to
itself. Measured on 2 cores (docs/testing.md): a serial run keeps the cores about
two thirds busy; the two workers together keep them busier. A second cluster for the
tests that only run jobs, on the other worker, was tried twice: with two clusters' jobs at
once the pool's tests took 1.7 times as long and the whole suite longer.

Several Ray clusters run on the machine at once (this pool, and the heads some modules
start): Ray's state API, asked with no address, picks the latest one; ask it with
``state_address()``.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import itertools
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from elastic.job_state import TERMINAL_STATES
from tests.pg_schema import scratch_schema

NAMESPACE = "elastic-train-tests"
TOKEN = "test-token-0123456789"
PG_URL_ENV = "ETRAIN_TEST_DATABASE_URL"
STORE_BACKENDS = ["sqlite", *(["postgresql"] if os.environ.get(PG_URL_ENV) else [])]


POOL_SIZE = 3
POOL_GROUP = "ray-pool"
# Modules that start a Ray head or a service of their own: first on the other worker, so
# that they are done before the pool's worker reaches its ``alone`` tests (kept last).
STARTS_ITS_OWN = (
    "test_hosts",
    "test_restarts",
    "test_installed_service",
    "test_gcs_ft",
    "test_ray_token_auth",
    "test_security_server",
    "test_serve",
)


# Pool modules whose jobs mostly wait (paced steps; the machine about half busy while they
# run): first on the pool's worker, while the other worker runs the tests that start their
# own Ray, so that those take the idle CPU and not the CPU of the pool's busiest tests.
POOL_FIRST = ("test_scheduler", "test_security", "test_limits_idempotency", "test_access")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """xdist's loadgroup hands out the pool's group as one unit (its tests in this order)
    and every other test as a unit of its own, in this order."""

    def order(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        if "ray_cluster" in item.fixturenames:
            if item.get_closest_marker("alone"):
                return 3
            return 1 if module in POOL_FIRST else 2
        return 0 if module in STARTS_ITS_OWN else 2

    for item in items:
        if "ray_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group(POOL_GROUP))
    if hasattr(config, "workerinput"):  # under xdist; a serial run keeps the files' order
        items.sort(key=order)  # stable: within a rank, the files' own order


class MachineShare:
    """Under xdist, the two workers share the machine through a readers-writer lock on two
    files: every test holds it shared; a test marked ``alone``, or a timed part of a test
    (:meth:`alone`), holds it exclusively, so that the other worker's tests wait while it
    runs. A waiting exclusive holder holds the turnstile, so that no new shared holder slips
    in ahead of it. Serially there is no other worker, and nothing to hold."""

    def __init__(self, files: tuple[IO[str], IO[str]] | None) -> None:
        self.files = files  # (turnstile, machine), or None serially

    def take(self, exclusive: bool) -> None:
        if self.files is None:
            return
        turnstile, machine = self.files
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)

    def give_back(self) -> None:
        if self.files is None:
            return
        turnstile, machine = self.files
        fcntl.flock(machine, fcntl.LOCK_UN)
        fcntl.flock(turnstile, fcntl.LOCK_UN)

    @contextmanager
    def alone(self) -> Iterator[None]:
        """The machine to this test alone for a timed part of it. The shared hold goes
        first: two workers that both asked while holding it shared would wait for each
        other."""
        self.give_back()
        self.take(exclusive=True)
        try:
            yield
        finally:
            self.give_back()
            self.take(exclusive=False)


# Under xdist, the niceness the worker that runs the tests off the pool takes (and every
# process it starts after: its Ray heads, its services). The pool's worker is the suite's
# critical path; the other worker's tests are done minutes before it and can take the CPU
# the pool's tests leave idle. (Niceness only goes up without privileges: once set, it
# stays for the worker's life, which holds no pool test after.)
OFF_POOL_NICENESS = 5


def yield_to_the_pool() -> None:
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current < OFF_POOL_NICENESS:
        os.setpriority(os.PRIO_PROCESS, 0, OFF_POOL_NICENESS)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture: a module's service or Ray head started for the test inherits it.
    if hasattr(item.config, "workerinput") and "ray_cluster" not in item.fixturenames:
        yield_to_the_pool()


@pytest.fixture(autouse=True)
def machine_share(request: pytest.FixtureRequest) -> Iterator[MachineShare]:
    worker = getattr(request.config, "workerinput", None)
    alone = request.node.get_closest_marker("alone") is not None
    if worker is None:
        yield MachineShare(None)
        return
    base = Path(tempfile.gettempdir()) / f"etrain-tests-{worker['testrunuid']}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.machine", "a") as machine:
        share = MachineShare((turnstile, machine))
        share.take(exclusive=alone)
        try:
            yield share
        finally:
            share.give_back()


class ClusterPool:
    """A head that trains nothing (it holds the supervisors) and a pool of one-CPU worker
    nodes that elastic tests may kill and add back."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.pool: list[Any] = []

    def add_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=1)
        self.pool.append(node)
        return node

    def kill_node(self, node: Any) -> None:
        """A real node failure: the raylet and its workers are killed, not shut down."""
        self.pool.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def kill_nodes_at_once(self, nodes: list[Any]) -> None:
        """Nodes that fail at the same instant: their raylets are SIGKILLed together (each
        node's workers end with their raylet), then the rest of each node's processes."""
        self.kill_nodes_apart(nodes, 0.0)

    def kill_nodes_apart(self, nodes: list[Any], apart_s: float) -> float:
        """Nodes that fail ``apart_s`` after one another (one rack, one spot pool): their
        raylets are SIGKILLed at those moments (each node's workers end with their raylet),
        then the rest of each node's processes. Returns the first kill's ``time.time()``."""
        from ray._private import ray_constants

        first = time.time()
        for n, node in enumerate(nodes):
            time.sleep(max(0.0, first + n * apart_s - time.time()))
            for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
                info.process.kill()
        for node in nodes:
            self.kill_node(node)
        return first

    def restore_pool(self) -> None:
        while len(self.pool) < POOL_SIZE:
            self.add_node()
        self.cluster.wait_for_nodes()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[ClusterPool]:
    """One real multi-node Ray cluster for the whole session: Ray is slow to start on 2 cores."""
    import ray
    from ray.cluster_utils import Cluster

    from jobs.launcher import FAST_FAILURE_DETECTION, keep_ray_on_loopback, worker_setup

    keep_ray_on_loopback()  # tests talk to no address but loopback
    os.environ.update(worker_setup())  # as the embedded cluster's processes start
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            # Not Ray's fixed 8265: another Ray on this machine may hold it.
            "dashboard_port": free_port(),
            "_system_config": FAST_FAILURE_DETECTION,
            # It tails every worker's log file for drivers that print them (ours do not):
            # about 4 % of a core for nothing, growing with the files.
            "include_log_monitor": False,
        },
    )
    test_cluster = ClusterPool(cluster)
    test_cluster.restore_pool()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield test_cluster
    ray.shutdown()
    cluster.shutdown()


def state_address() -> str:
    """The address for Ray's state API (``list_actors``...) of the cluster this process is
    connected to: with none, the API picks the latest Ray on the machine, which may be a
    head another module started."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def end_every_job(timeout_s: float = 60.0) -> list[str]:
    """Kill every job supervisor on the test cluster (which ends its attempt and workers),
    remove the placement groups left behind, and wait until the pool's CPUs are free again.
    Returns the supervisors' names, so a caller can tell that something was left running."""
    import ray
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    from elastic.in_place.lighthouse import HOST_NAME
    from jobs.launcher import ACTOR_PREFIX

    killed = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not actor["name"].startswith(ACTOR_PREFIX):
            continue
        try:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        except ValueError:
            continue  # it ended on its own between the listing and the lookup
        ray.kill(handle, no_restart=True)
        killed.append(actor["name"])
    # In place, a job's detached replicas (named after its supervisor: killed above) and its
    # lighthouse (held by the cluster's lighthouse host) outlive its supervisor.
    try:
        host = ray.get_actor(HOST_NAME, namespace=NAMESPACE)
    except ValueError:
        host = None
    if host is not None:
        ray.get([host.close.remote(name) for name in killed])
    # The test's service is gone: the queued jobs it booked as rows go with it (a service
    # started over the same cluster would unbook them itself, at its first look).
    from elastic.cluster.capacity import shared_watcher

    ray.get(shared_watcher(NAMESPACE).hold_rows.remote([]))
    for pg_id, pg in placement_group_table().items():
        if pg["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    wait_until_the_pool_is_free(timeout_s)
    return killed


# How long a supervisor may outlive its job's end: the service stops it once it has stored
# the job's terminal state (it polls its events every 0.2-1 s).
SUPERVISOR_AFTER_END_S = 15.0


def supervisors_outliving_their_job(grace_s: float = SUPERVISOR_AFTER_END_S) -> list[str]:
    """The supervisors still alive ``grace_s`` after their job ended, with its state: a
    leak (each holds a process, and its job's Ray resources, forever)."""
    import ray

    from jobs.launcher import ACTOR_PREFIX

    deadline = time.monotonic() + grace_s
    while True:
        ended = []
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if not actor["name"].startswith(ACTOR_PREFIX):
                continue
            try:
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                state = ray.get(handle.status.remote(), timeout=5)["state"]
            except Exception:  # it ended meanwhile, or does not answer
                continue
            if state in TERMINAL_STATES:
                ended.append(f"{actor['name']} ({state})")
        if not ended or time.monotonic() > deadline:
            return ended
        time.sleep(0.5)


def wait_until_the_scheduler_sees_the_pool(timeout_s: float = 30.0) -> None:
    """The cluster's scheduler (the shared membership watcher, which polls Ray every 0.5 s)
    sees every node of the pool with its CPU free and unclaimed, and plans for no job: a job
    submitted now starts at the pool's full size, not on the part of a restored pool the
    watcher has seen, nor beside a killed job the scheduler still plans for (it forgets a
    supervisor that died without saying so within elastic.cluster.capacity.SCHEDULER_CHECK_S; two
    jobs were seen to start at 1 worker of 3 in that window)."""
    import ray

    from elastic.cluster.capacity import shared_watcher

    watcher = shared_watcher(NAMESPACE)

    def whole() -> bool:
        snap = ray.get(watcher.snapshot.remote("", -1, 0.0))
        view = ray.get(watcher.queue.remote())
        return bool(
            snap.workers_free({"CPU": 1.0}) >= POOL_SIZE
            and not view["running"]
            and not view["queue"]
        )

    wait_for(whole, timeout_s, what="the scheduler to see the whole pool free and no job")


def wait_until_the_pool_is_free(timeout_s: float = 60.0) -> None:
    """Every CPU of the cluster free: a job that ended by itself (or was killed above) hands
    its workers back asynchronously, and the next test's job must not start on what is
    left (it would start smaller and grow, which some tests count)."""
    import ray

    wait_for(
        lambda: ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0),
        timeout_s,
        what="the pool's CPUs to be free after the test's jobs",
    )


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that failed half-way (before it cancelled its 1 000 000-step job) must not leave
    a detached supervisor holding the shared pool for every later test."""
    if "ray_cluster" not in request.fixturenames:
        yield
        return
    pool = request.getfixturevalue("ray_cluster")
    yield
    # Supervisors of jobs the test left running are ended below; one whose job ended and
    # that the service did not stop is a leak, reported.
    leaked = supervisors_outliving_their_job()
    end_every_job()
    pool.restore_pool()
    wait_until_the_pool_is_free()
    # The next test's job must start at the pool's full size (several tests count resizes
    # or the first size; seen: a restarted service's job started at 1 of 2 just after a
    # test had added a node back).
    wait_until_the_scheduler_sees_the_pool()
    assert not leaked, (
        f"supervisors alive {SUPERVISOR_AFTER_END_S:.0f} s after their job ended: {leaked}"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """The real app under a real uvicorn on a loopback port, in a background thread."""

    def __init__(self, settings: Any) -> None:
        import uvicorn

        from service.app import create_app

        self.settings = settings
        self.app = create_app(settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@functools.cache
def shared_checkpoint_dir() -> Path:
    """One checkpoint directory for every test service of this process. A service probes
    each Ray node once per checkpoint directory (``elastic/checkpoint/storage.py``: a worker
    process per node): with a directory per test, every test's first job paid for three
    probe processes, 148 of the 400 worker processes of a whole run. Job ids are unique, so
    the tests' jobs do not meet in it; ``test_checkpoint_visibility`` probes directories of
    its own."""
    path = Path(tempfile.mkdtemp(prefix="etrain-test-checkpoints-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def make_settings(data_dir: Path, **overrides: Any) -> Any:
    """Settings of a test service: its own files under ``data_dir/service``; jobs may read
    the rest of ``data_dir`` (the data root). Unless the test names its own checkpoint
    directory, checkpoints go to :func:`shared_checkpoint_dir`, seen from the test as
    ``data_dir/checkpoints``."""
    from service.settings import Settings

    if "checkpoint_dir" not in overrides:
        link = data_dir / "checkpoints"
        if not link.is_symlink():
            data_dir.mkdir(parents=True, exist_ok=True)
            link.symlink_to(shared_checkpoint_dir(), target_is_directory=True)
    values: dict[str, Any] = {
        "data_dir": data_dir / "service",
        "checkpoint_dir": str(shared_checkpoint_dir()),
        "data_roots": [str(data_dir)],
        "api_token": TOKEN,
        "ray_namespace": NAMESPACE,
        "event_poll_interval_s": 0.2,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def server(ray_cluster: Any, tmp_path: Path) -> Iterator[LiveServer]:
    with LiveServer(make_settings(tmp_path)) as live:
        yield live


def wait_for(predicate: Any, timeout: float, interval: float = 0.2, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def wait_until_ended(
    client: httpx.Client, job_id: str, timeout: float = 300, interval: float = 0.2
) -> dict[str, Any]:
    """Poll the API until the job is in an end state; its last view."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (j := client.get(f"/v1/jobs/{job_id}").json())["state"] in TERMINAL_STATES and j,
        timeout,
        interval,
        what=f"job {job_id} to end",
    )


def all_events(client: httpx.Client, job_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    """Every event of a job (of ``kind`` only, when given), page after page."""
    events: list[dict[str, Any]] = []
    after = 0
    only = {"kind": kind} if kind else {}
    while True:
        page = client.get(
            f"/v1/jobs/{job_id}/events", params={"after": after, "limit": 1000, **only}
        )
        events += page.json()["items"]
        if page.json()["next_after"] == after:
            return events
        after = page.json()["next_after"]


def longest_pause_after(at: float, events: list[dict[str, Any]], window_s: float = 30.0) -> float:
    """The longest time the job went without a step within ``window_s`` after ``at`` (a
    failure's time), the stretch that spans ``at`` counted from ``at``; ``events`` holds
    its ``metrics`` events (as the API gives them)."""
    times = sorted(datetime.fromisoformat(e["time"]).timestamp() for e in events)
    gaps = [
        later - max(earlier, at)
        for earlier, later in itertools.pairwise(times)
        if later > at and earlier < at + window_s
    ]
    return max(gaps)


def small_job(**hyper: Any) -> dict[str, Any]:
    """The README's example job, adjustable."""
    hp = {
        "model": "small_cnn",
        "dataset": "synthetic",
        "max_steps": 50,
        "global_batch_size": 64,
        "learning_rate": 0.05,
        "seed": 0,
    }
    hp.update(hyper)
    return {
        "name": "demo",
        "workload": "image-classification",
        "hyperparameters": hp,
        "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 10, "keep": 3},
    }


@contextmanager
def database_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a schema of its own on the PostgreSQL of
    ETRAIN_TEST_DATABASE_URL (dropped afterwards), so runs never see each other's tables."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'etrain.db'}"
        return
    with scratch_schema(os.environ[PG_URL_ENV], "etrain_test") as scoped:
        yield scoped


@pytest.fixture(params=STORE_BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(store_backend: str, tmp_path: Path) -> Iterator[Any]:
    """A migrated store on a fresh database of each backend."""
    from service.store import Store

    with database_url(store_backend, tmp_path) as url:
        s = Store(url)
        yield s
        s.close()


def create_user_token(client: httpx.Client, name: str, role: str = "user") -> str:
    """A user made through the API (by an admin client) and a token of theirs."""
    r = client.post("/v1/users", json={"name": name, "role": role})
    assert r.status_code in (201, 409), r.text
    r = client.post("/v1/tokens", json={"user": name, "label": "tests"})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])
