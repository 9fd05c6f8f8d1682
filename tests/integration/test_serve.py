"""`etrain serve` as `make run` starts it, on a machine where its ports may be taken: the
service's own (8000), or the one Ray's dashboard takes by default (8265, held by any other
Ray on the machine). A real process each time; only the last test starts Ray."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TOKEN, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
RAY_DEFAULT_DASHBOARD_PORT = 8265


def environment(data_dir: Path, **settings: str) -> dict[str, str]:
    """A user's environment with no ETRAIN_ or RAY_ settings of its own but ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETRAIN_", "RAY_"))}
    return {**env, "ETRAIN_DATA_DIR": str(data_dir), **settings}


def serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_train.cli", "serve", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("how", ["--port", "ETRAIN_PORT"])
def test_a_port_in_use_stops_serve_at_once_naming_the_setting(
    taken_port: int, tmp_path: Path, how: str
) -> None:
    """Not after Ray's start (17 s) with uvicorn's `address already in use`: before anything
    is started, printed or written (a new admin token is shown once: not on a failed start)."""
    data_dir = tmp_path / "data"
    if how == "--port":
        done = serve(environment(data_dir), "--port", str(taken_port))
    else:
        done = serve(environment(data_dir, ETRAIN_PORT=str(taken_port)))
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"error: 127.0.0.1:{taken_port} is already in use; "
        "choose another port with --port or ETRAIN_PORT\n"
    )
    assert not data_dir.exists()  # no store, no token: nothing was started


def test_a_dashboard_port_set_and_in_use_stops_serve_at_once(
    taken_port: int, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    done = serve(
        environment(
            data_dir, ETRAIN_PORT=str(free_port()), ETRAIN_RAY_DASHBOARD_PORT=str(taken_port)
        )
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"error: 127.0.0.1:{taken_port}, the embedded Ray's dashboard port, is already in "
        "use; choose another with ETRAIN_RAY_DASHBOARD_PORT, or unset it for a free one\n"
    )
    assert not data_dir.exists()


def test_with_rays_default_dashboard_port_taken_serve_starts_and_says_where_it_is(
    tmp_path: Path,
) -> None:
    """Another Ray on the machine holds 8265 (here a listener of the test's, unless some
    program already holds it): the embedded Ray's dashboard takes another port, and the log
    says which."""
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", RAY_DEFAULT_DASHBOARD_PORT))
        held.listen()
    except OSError:
        held.close()  # taken already, as the test needs it
    port = free_port()
    log = tmp_path / "serve.log"
    env = environment(
        tmp_path / "data",
        ETRAIN_PORT=str(port),
        ETRAIN_API_TOKEN=TOKEN,
        ETRAIN_RAY_NUM_CPUS="1",
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_train.cli", "serve"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=180, interval=0.5, what="etrain serve to be ready")
        said = re.findall(
            r"the embedded Ray's dashboard is on (http://127\.0\.0\.1:(\d+))\n", log.read_text()
        )
        assert len(said) == 1, log.read_text()[-3000:]
        # The sockets bound before Ray started are the ones it listens on, and it says so.
        assert f"Uvicorn running on http://127.0.0.1:{port} " in log.read_text()
        url, dashboard_port = said[0]
        assert int(dashboard_port) != RAY_DEFAULT_DASHBOARD_PORT
        # Ray's dashboard answers there (this page is open: its sign-in asks it first).
        mode = httpx.get(f"{url}/api/authentication_mode", timeout=10)
        assert mode.status_code == 200 and set(mode.json()) == {"authentication_mode"}
    finally:
        held.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, log.read_text()[-3000:]
