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


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local multi-node-capable Ray cluster, started once: Ray is slow to start on 2 cores."""
    import ray
    from ray.cluster_utils import Cluster

    from jobs.launcher import keep_ray_on_loopback

    keep_ray_on_loopback()  # tests talk to no address but loopback

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
        },
    )
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield cluster
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
