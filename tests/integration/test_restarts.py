"""The API process dies (SIGKILL) while jobs run, and comes back after 0, 20 and 60 s; then it
is stopped gracefully (SIGTERM) with a live stream open. A real `etrain serve` subprocess on
a Ray head of this module's own with three CPUs (ETRAIN_RAY_ADDRESS), the same data dir and
database throughout. Not on the session's shared pool: the downtimes would hold it idle for
80 s while other tests could use it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobs.launcher import supervisor_name
from tests.conftest import NAMESPACE, TOKEN, MachineShare, all_events, free_port, wait_for
from tests.integration.test_streams import SSE, iter_sse
from tests.ray_head import blocking_head, clean_env

REPO = Path(__file__).resolve().parents[2]


def ray_env() -> dict[str, str]:
    """For the head, the service and drivers alike: `ray start` turns token auth on by itself
    when ~/.ray/auth_token exists (another test may leave one); this module is not about it."""
    return clean_env() | {"RAY_AUTH_MODE": "disabled"}


HOLD_AT, MAX_STEPS = 10, 30


class Api:
    """`etrain serve` as a real process."""

    def __init__(self, ray_address: str, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / "serve.log"
        self.ray_address = ray_address
        self.env = {
            **ray_env(),
            "ETRAIN_RAY_ADDRESS": ray_address,
            "ETRAIN_RAY_NAMESPACE": NAMESPACE,
            "ETRAIN_DATA_DIR": str(data_dir),
            "ETRAIN_API_TOKEN": TOKEN,
            "ETRAIN_PORT": str(self.port),
            "ETRAIN_EVENT_POLL_INTERVAL_S": "0.2",
            "ETRAIN_LOG_LEVEL": "warning",
            "ETRAIN_ENTRYPOINT_MODULES": json.dumps(["tests.workloads"]),
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
        wait_for(self._ready, timeout=120, interval=0.5, what="etrain serve to be ready")

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(60)
        self.proc = None
        return code

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}
        )

    def kill_supervisor(self, job_id: str) -> None:
        """The job's Ray side vanishes: its supervisor actor is killed, from a driver of its
        own (this test process talks to no Ray)."""
        name = supervisor_name(job_id)
        code = (
            "import ray; "
            f"ray.init(address={self.ray_address!r}, namespace={NAMESPACE!r}); "
            f"ray.kill(ray.get_actor({name!r}), no_restart=True)"
        )
        subprocess.run([sys.executable, "-c", code], env=ray_env(), check=True, timeout=120)


def gated_job(name: str, gate: Path) -> dict[str, Any]:
    return {
        "name": name,
        "workload": "tests.workloads.gated:train_loop",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "max_steps": MAX_STEPS,
            "global_batch_size": 32,
            "learning_rate": 0.05,
            "seed": 0,
            "gate": str(gate),
            "hold_at_step": HOLD_AT,
        },
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 5, "keep": 2},
        # This test is about the API's restarts. In place, a replica's heartbeats are judged
        # within 0.3 s, and this test runs beside others on a loaded 2-core machine (in-place
        # robustness under load is tests/integration/test_in_place_saturated.py's).
        "fault_tolerance": "restart",
    }


def snapshot(client: httpx.Client, waiting: str | None = None) -> list[tuple[Any, ...]]:
    """The job rows as the list shows them. The ``waiting`` job (no node is free for it) may
    try to place its workers and go back to the queue meanwhile: only its progress counts."""
    items = client.get("/v1/jobs").json()["items"]
    return [
        (j["id"], j["name"], j["step"], j["world_size"])
        if j["id"] == waiting
        else (j["id"], j["name"], j["state"], j["step"], j["world_size"], j["restarts"])
        for j in items
    ]


def history(client: httpx.Client, job_id: str) -> tuple[list[str], int]:
    events = all_events(client, job_id)
    return (
        [e["data"]["state"] for e in events if e["kind"] == "state"],
        sum(e["kind"] == "attempt_started" for e in events),
    )


def reasons(client: httpx.Client, job_id: str) -> list[tuple[str, str, Any]]:
    """When and why the job changed state: what a failed history check needs to be read."""
    return [
        (e["time"], e["data"]["state"], e["data"].get("reason"))
        for e in all_events(client, job_id)
        if e["kind"] == "state"
    ]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with blocking_head(ray_env(), num_cpus=3, prefix="erst-") as address:
        server = Api(address, tmp_path)
        yield server
        if server.proc is not None:
            server.kill()


def test_jobs_survive_api_sigkills_and_a_graceful_stop(
    api: Api, tmp_path: Path, machine_share: MachineShare
) -> None:
    gate = tmp_path / "release"
    api.start()
    with api.client() as client:
        ids = []
        for name in ("a", "b", "c"):  # one per one-CPU node
            r = client.post("/v1/jobs", json=gated_job(name, gate))
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])

        def held() -> list[str]:
            return [j for j in ids if client.get(f"/v1/jobs/{j}").json()["step"] == HOLD_AT]

        wait_for(
            lambda: len(held()) == 3,
            timeout=240,
            interval=0.5,
            what=f"three jobs to reach step {HOLD_AT}",
        )
        # The fourth finds no free node and waits. It is sent once the others hold their nodes:
        # supervisors that start together race for the same free slots (no scheduler yet
        # orders them), which this test is not about.
        r = client.post("/v1/jobs", json=gated_job("d", gate))
        assert r.status_code == 201, r.text
        waiting = r.json()["id"]
        survivors, vanished = ids[:2], ids[2]
        ids.append(waiting)
        before = snapshot(client, waiting)
        rows = {row[0]: row for row in snapshot(client)}
    assert {rows[j][2:4] for j in (*survivors, vanished)} == {("running", HOLD_AT)}
    # The fourth waits for a node: its supervisor may already be trying to place it.
    assert rows[waiting][2:4] in {("queued", 0), ("starting", 0)}

    for downtime in (0, 20, 60):
        assert api.kill() == -signal.SIGKILL
        down_at = time.monotonic()
        if downtime == 60:  # one job's Ray side vanishes while the API is down
            api.kill_supervisor(vanished)
        time.sleep(max(0.0, downtime - (time.monotonic() - down_at)))
        api.start()
        with api.client() as client:
            if downtime < 60:
                assert snapshot(client, waiting) == before, downtime
                assert client.get(f"/v1/jobs/{waiting}").json()["state"] in {"queued", "starting"}
                continue

            # It had checkpoints (every 5 steps, held at 10): a new supervisor resumes it
            # from the latest one, and says so.
            def recreated() -> Any:
                page = client.get(
                    f"/v1/jobs/{vanished}/events", params={"kind": "supervisor_recreated"}
                )
                return next(iter(page.json()["items"]), None)

            note = wait_for(recreated, timeout=60, what="the vanished job's new supervisor")
            assert note["data"]["checkpoint_step"] == HOLD_AT
            # While it had no supervisor, the scheduler may have given its node to the waiting
            # job: then it waits in the queue (its reason says so) rather than recovers.
            assert client.get(f"/v1/jobs/{vanished}").json()["state"] in {
                "recovering",
                "running",
                "queued",
            }
            # Cancelled, it gives back its node (whether it had won it again or not): the
            # waiting job starts.
            assert client.post(f"/v1/jobs/{vanished}/cancel").json()["state"] == "cancelled"
            wait_for(
                lambda: client.get(f"/v1/jobs/{waiting}").json()["state"] == "running",
                timeout=120,
                interval=0.5,
                what="the waiting job to start",
            )
            after = {row[0]: row for row in snapshot(client)}
            assert [after[j] for j in survivors] == [rows[j] for j in survivors]

    # A graceful stop: a live stream is closed with a last message, a request in flight (its
    # body still arriving, for 2 s) finishes, and the process is gone within the README's
    # 5 s for in-flight requests (+1 s to exit); the jobs train on.
    uploading = threading.Event()

    def slow_body() -> Iterator[bytes]:
        yield b'{"name": "late-user", '
        uploading.set()
        for _ in range(4):
            time.sleep(0.5)
            yield b"   "
        yield b'"role": "user"}'

    # Timed: under xdist the other worker's tests wait meanwhile (tests/conftest.py).
    with machine_share.alone():
        with (
            api.client() as client,
            ThreadPoolExecutor(1) as pool,
            client.stream(
                "GET", f"/v1/jobs/{survivors[0]}/events", headers=SSE, timeout=60
            ) as stream,
        ):
            lines = stream.iter_lines()
            first = next(iter_sse(lines))
            assert first["id"] == "1"
            headers = {"content-type": "application/json"}
            in_flight = pool.submit(client.post, "/v1/users", content=slow_body(), headers=headers)
            assert uploading.wait(10)
            stopped_at = time.monotonic()
            assert api.proc is not None
            api.proc.send_signal(signal.SIGTERM)
            rest = list(iter_sse(lines))  # ends without an error: the server closed it cleanly
            closed_after = time.monotonic() - stopped_at
            assert rest[-1]["event"] == "reconnect"
            assert rest[-1]["data"]["reason"].startswith("the service is shutting down")
            finished = in_flight.result(timeout=30)
            assert finished.status_code == 201, finished.text
            assert time.monotonic() - stopped_at >= 2  # it was still arriving when the stop began
        assert api.proc.wait(30) == 0
        exited_after = time.monotonic() - stopped_at
        assert closed_after < 2, closed_after  # streams are told at once, not at the deadline
        assert exited_after < 6, exited_after
    api.proc = None
    assert "Traceback" not in api.log.read_text().split("Uvicorn running")[-1]

    api.start()
    with api.client() as client:
        users = {u["name"] for u in client.get("/v1/users").json()["items"]}
        assert "late-user" in users  # what the in-flight request did was kept
        assert client.post(f"/v1/jobs/{waiting}/cancel").json()["state"] == "cancelled"
        gate.touch()
        for job_id in survivors:
            done = wait_for(
                lambda j=job_id: (
                    (x := client.get(f"/v1/jobs/{j}").json())["state"] in {"succeeded", "failed"}
                    and x
                ),
                timeout=120,
                what="a job to finish",
            )
            assert (done["state"], done["step"]) == ("succeeded", MAX_STEPS), done
            assert history(client, job_id) == (
                ["queued", "starting", "running", "succeeded"],
                1,
            ), reasons(client, job_id)  # never started twice
        assert history(client, waiting)[0][-2:] == ["running", "cancelled"]
