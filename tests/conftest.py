"""Shared test fixtures: one real Ray cluster per session, real servers on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

NAMESPACE = "elastic-train-tests"
TOKEN = "test-token-0123456789"


POOL_SIZE = 3


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

    def restore_pool(self) -> None:
        while len(self.pool) < POOL_SIZE:
            self.add_node()
        self.cluster.wait_for_nodes()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[ClusterPool]:
    """One real multi-node Ray cluster for the whole session: Ray is slow to start on 2 cores."""
    import ray
    from ray.cluster_utils import Cluster

    from jobs.launcher import FAST_FAILURE_DETECTION, keep_ray_on_loopback

    keep_ray_on_loopback()  # tests talk to no address but loopback
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "_system_config": FAST_FAILURE_DETECTION,
        },
    )
    test_cluster = ClusterPool(cluster)
    test_cluster.restore_pool()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield test_cluster
    ray.shutdown()
    cluster.shutdown()


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


def make_settings(data_dir: Path, **overrides: Any) -> Any:
    from service.settings import Settings

    values: dict[str, Any] = {
        "data_dir": data_dir,
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


def small_job(**hyper: Any) -> dict[str, Any]:
    """The README's example job, adjustable."""
    hp = {"model": "small_cnn", "dataset": "synthetic", "max_steps": 50,
          "global_batch_size": 64, "learning_rate": 0.05, "seed": 0}
    hp.update(hyper)
    return {
        "name": "demo",
        "workload": "image-classification",
        "hyperparameters": hp,
        "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 10, "keep": 3},
    }
