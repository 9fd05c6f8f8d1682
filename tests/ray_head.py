"""A separate Ray head and an `etrain serve` pointed at it, as subprocesses: for the tests
that need a Ray the suite's own cluster cannot be (token auth, GCS fault tolerance)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.conftest import TOKEN, free_port


def clean_env() -> dict[str, str]:
    """This process's environment without any Ray or service settings of the test session,
    with Ray kept on loopback addresses (as jobs.launcher.keep_ray_on_loopback does): the
    head and the service's driver must agree on the node's address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETRAIN_", "RAY_"))}
    return env | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def head_command(port: int, temp: str, *, block: bool) -> list[str]:
    """`ray start --head` on loopback with 2 CPUs, no dashboard, and ports of its own.
    ``temp`` must be a short path (Ray's socket paths are limited)."""
    return [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        *(["--block"] if block else []),
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        "--include-dashboard=false",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp}",
    ]


def serve_env(tmp: Path, address: str, port: int) -> dict[str, str]:
    """The environment of an `etrain serve` on ``port`` that uses the Ray at ``address``."""
    return clean_env() | {
        "ETRAIN_PORT": str(port),
        "ETRAIN_DATA_DIR": str(tmp / "service"),
        "ETRAIN_CHECKPOINT_DIR": str(tmp / "checkpoints"),
        "ETRAIN_API_TOKEN": TOKEN,
        "ETRAIN_RAY_ADDRESS": address,
        "ETRAIN_EVENT_POLL_INTERVAL_S": "0.2",
    }
