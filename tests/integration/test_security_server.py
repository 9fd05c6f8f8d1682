"""Issue 13's findings that need the service exactly as `etrain serve` runs it: a real
process on the embedded default (it starts its own Ray, as `make run` does), with its
secrets in its environment. What reaches a job's workers, and the HTTP server's limits
(header size, unfinished headers, connections), tested with raw sockets."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TOKEN, free_port, wait_for
from tests.workloads.env_probe import MARKER

REPO = Path(__file__).resolve().parents[2]
MAX_CONNECTIONS = 40
HEADER_TIMEOUT_S = 2.0
MIB = 1 << 20


class Serve:
    """`etrain serve` on the embedded default, as a real process."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ETRAIN_", "RAY_"))}
        self.env = {
            **env,
            "ETRAIN_DATA_DIR": str(data_dir),
            "ETRAIN_API_TOKEN": TOKEN,
            "ETRAIN_DATABASE_URL": f"sqlite:///{data_dir / 'secret-place.db'}",
            "ETRAIN_PORT": str(self.port),
            "ETRAIN_RAY_NUM_CPUS": "1",
            "ETRAIN_RAY_DASHBOARD_PORT": str(free_port()),
            "ETRAIN_LOG_LEVEL": "warning",
            "ETRAIN_ENTRYPOINT_MODULES": json.dumps(["tests.workloads"]),
            "ETRAIN_WORKER_ENV": json.dumps(["MY_TEAM_*"]),
            "ETRAIN_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "ETRAIN_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "MY_TEAM_SETTING": "1",  # added to the allow-list above
            "AWS_SECRET_ACCESS_KEY": "not-for-jobs",  # on no allow-list
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "serve"],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._ready, timeout=180, interval=0.5, what="etrain serve to be ready")

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}
        )

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    server = Serve(tmp_path_factory.mktemp("serve"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (what it sent first, if
    anything, is read and dropped)."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def test_job_workers_see_none_of_the_services_secrets(serve: Serve) -> None:
    with serve.client() as client:
        spec = {
            "name": "env",
            "workload": "tests.workloads.env_probe:train_loop",
            "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        }
        r = client.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job = wait_for(
            lambda: (
                (j := client.get(f"/v1/jobs/{r.json()['id']}").json())["state"]
                in ("succeeded", "failed", "cancelled")
                and j
            ),
            180,
            what="the probe job to end",
        )
        assert job["state"] == "succeeded", job
        lines = [i["line"] for i in client.get(f"/v1/jobs/{job['id']}/logs").json()["items"]]
    (probe,) = [ln for ln in lines if ln.startswith(MARKER)]
    names = set(json.loads(probe[len(MARKER) :]))
    assert not {n for n in names if n.startswith("ETRAIN_")}, sorted(names)
    assert "AWS_SECRET_ACCESS_KEY" not in names and "RAY_AUTH_TOKEN" not in names
    assert {"PATH", "MY_TEAM_SETTING"} <= names


def test_a_32_mib_header_is_refused(serve: Serve) -> None:
    with serve.connect() as sock:
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 * MIB) + b"\r\n\r\n"
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(head)  # cut off while sending: refused
        sock.settimeout(10)
        try:
            answer = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            answer = b""
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_unfinished_big_headers_do_not_grow_the_service(serve: Serve) -> None:
    """Ten connections each sending 48 MiB of a header that never ends: the service's memory
    grows by less than 32 MiB (each connection's buffer is capped at max_header_bytes)."""
    before = serve.rss_mib()
    socks = [serve.connect() for _ in range(10)]
    chunk = b"a" * MIB
    try:
        for sock in socks:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
            try:
                for _ in range(48):
                    sock.sendall(chunk)
            except (ConnectionResetError, BrokenPipeError):
                pass
        time.sleep(1)
        grown = serve.rss_mib() - before
    finally:
        for sock in socks:
            sock.close()
    print(f"ten unfinished 48 MiB headers: the service grew by {grown:.1f} MiB")  # docs cite it
    assert grown < 32, f"the service grew by {grown:.0f} MiB"
    assert httpx.get(serve.url + "/healthz", timeout=10).status_code == 200


def test_headers_that_never_end_are_cut_off(serve: Serve) -> None:
    with serve.connect() as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
        began = time.monotonic()
        assert closed_by_server(sock, HEADER_TIMEOUT_S + 5)
        assert time.monotonic() - began >= HEADER_TIMEOUT_S - 0.5


def test_connections_past_the_cap_are_closed(serve: Serve) -> None:
    socks = [serve.connect() for _ in range(MAX_CONNECTIONS + 20)]
    try:
        time.sleep(0.5)  # well within the header timeout: only the cap closes any yet
        readable, _, _ = select.select(socks, [], [], 0)
        closed = sum(not s.recv(1) for s in readable)
        assert 20 <= closed <= 20 + 2, closed  # the ones past the cap, give or take a probe
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    assert httpx.get(serve.url + "/healthz", timeout=10).status_code == 200


def test_nul_bytes_in_paths_are_404_on_the_real_server(serve: Serve) -> None:
    for path in ("/ui/%00", "/docs-assets/%00", "/ui/vendor/uplot/%00"):
        r = httpx.get(serve.url + path, timeout=10)
        assert r.status_code == 404, (path, r.status_code)
