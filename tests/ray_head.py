"""A separate Ray head and an `etrain serve` pointed at it, as subprocesses: for the tests
that need a Ray the suite's own cluster cannot be (token auth, GCS fault tolerance), or
that must not hold its pool while they wait (the API restarts' downtimes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.conftest import TOKEN, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]


def clean_env() -> dict[str, str]:
    """This process's environment without any Ray or service settings of the test session,
    with Ray kept on loopback addresses (as jobs.launcher.keep_ray_on_loopback does): the
    head and the service's driver must agree on the node's address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETRAIN_", "RAY_"))}
    return env | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def head_command(port: int, temp: str, *, block: bool, num_cpus: int = 2) -> list[str]:
    """`ray start --head` on loopback with ``num_cpus`` CPUs, no dashboard, and ports of its
    own. ``temp`` must be a short path (Ray's socket paths are limited)."""
    return [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        *(["--block"] if block else []),
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}",
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


@contextmanager
def blocking_head(
    env: dict[str, str], *, num_cpus: int = 2, prefix: str = "ehead-"
) -> Iterator[str]:
    """A Ray head in its own process group (`ray start --block`), killed whole at the end;
    yields its address once a driver with ``env`` can connect to it."""
    port = free_port()
    # Ray's socket paths must stay short: a fresh directory right under /tmp.
    temp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    head = subprocess.Popen(
        head_command(port, temp, block=True, num_cpus=num_cpus),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        probe = [sys.executable, "-c", f"import ray; ray.init(address='{address}')"]
        wait_for(
            lambda: (
                head.poll() is None
                and subprocess.run(probe, env=env, capture_output=True, timeout=60).returncode == 0
            ),
            timeout=120,
            interval=1,
            what=f"the Ray head at {address} to accept a driver",
        )
        yield address
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        head.wait(timeout=30)


@contextmanager
def served(env: dict[str, str], log: Path) -> Iterator[httpx.Client]:
    """``etrain serve`` with ``env`` (its port in ``ETRAIN_PORT``), its output in ``log``;
    yields a client of its API once it is ready, and stops it (SIGTERM) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("etrain")), "serve"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{env['ETRAIN_PORT']}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return api.get("/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, timeout=120, interval=0.5, what="the service to be ready")
        yield api
    finally:
        api.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
