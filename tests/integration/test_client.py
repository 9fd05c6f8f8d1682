"""The Python client (sync and async) against the real service: a live uvicorn on loopback,
the session's Ray cluster, no mocked HTTP. A TCP relay in front of the server cuts a live
stream mid-job, as a network failure or a load balancer would."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from elastic.job_state import TERMINAL_STATES
from elastic_train import (
    AsyncClient,
    Client,
    Conflict,
    ConnectionFailed,
    Forbidden,
    InvalidRequest,
    JobState,
    NotFound,
    Unauthorized,
)
from tests.conftest import (
    TOKEN,
    LiveServer,
    create_user_token,
    make_settings,
    small_job,
    wait_for,
)

HOLD_AT = 10
MAX_STEPS = 50  # the README job's


@pytest.fixture(scope="module")
def live(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # A small per-client buffer: live readers that fall 2 events behind are told to
    # reconnect, so the clients here also resume after the service's own `reconnect`.
    settings = make_settings(
        tmp_path_factory.mktemp("client"),
        entrypoint_modules=["tests.workloads"],
        sse_client_buffer=2,
    )
    with LiveServer(settings) as server:
        yield server


@contextmanager
def jobs_ended(server: LiveServer) -> Iterator[None]:
    """Whatever happens in the block, no job of this server is left running afterwards
    (a detached supervisor would hold the shared pool)."""
    try:
        yield
    finally:
        with server.client() as api:
            for job in api.get("/v1/jobs", params={"limit": 500}).json()["items"]:
                if job["state"] not in TERMINAL_STATES:
                    api.post(f"/v1/jobs/{job['id']}/cancel")
            wait_for(
                lambda: all(
                    j["state"] in TERMINAL_STATES
                    for j in api.get("/v1/jobs", params={"limit": 500}).json()["items"]
                ),
                timeout=60,
                what="every job to end",
            )


def gated_job(gate: Path) -> dict[str, Any]:
    """The README job, held after step HOLD_AT until ``gate`` exists."""
    spec = small_job(gate=str(gate), hold_at_step=HOLD_AT)
    spec["workload"] = "tests.workloads.gated:train_loop"
    return spec


def chatty_job(**hyper: Any) -> dict[str, Any]:
    """Two workers that print to stdout and stderr, log and warn (no metrics)."""
    return {
        "name": "chatty",
        "workload": "tests.workloads.chatty:train_loop",
        "hyperparameters": {"steps": 3, **hyper},
        "scaling": {"min_workers": 2, "max_workers": 2},
        "failure": {"max_restarts": 0},
    }


def api_get(server: LiveServer, path: str, **params: Any) -> Any:
    with server.client() as api:
        r = api.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()


class CuttableRelay:
    """A TCP relay to the server whose open connections the test can cut at once; it keeps
    the head of every request that passes, to see what a reconnecting client sends."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.requests: list[tuple[float, str]] = []
        self.reconnects_asked = 0  # `event: reconnect` messages the service sent through it
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self.lock:
                self.sockets += [down, up]
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and data[:4] in (b"GET ", b"POST"):
                    head = data.split(b"\r\n\r\n", 1)[0].decode(errors="replace")
                    with self.lock:
                        self.requests.append((time.monotonic(), head))
                if not from_client:
                    self.reconnects_asked += data.count(b"event: reconnect")
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._drop(s)

    @staticmethod
    def _drop(s: socket.socket) -> None:
        with suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()

    def cut(self) -> float:
        """Drop every open connection mid-stream; the moment it happened."""
        with self.lock:
            cut, self.sockets = self.sockets, []
        for s in cut:
            self._drop(s)
        return time.monotonic()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_job_is_watched_live_and_a_cut_stream_resumes_where_it_stopped(
    live: LiveServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    relay = CuttableRelay(live.port)
    followed: list[Any] = []
    follower_error: list[BaseException] = []

    def follow(client: Client, job_id: str) -> None:
        try:
            followed.extend(client.job(job_id).events(follow=True))
        except BaseException as e:
            follower_error.append(e)

    with (
        jobs_ended(live),
        Client(live.url, TOKEN) as client,
        Client(relay.url, TOKEN, reconnect_for=30) as relayed,
    ):
        job = client.submit(gated_job(gate))
        assert job.state == JobState.QUEUED
        follower = threading.Thread(target=follow, args=(relayed, job.id), daemon=True)
        follower.start()

        arrivals: list[tuple[float, int]] = []
        state_when_held = None
        cut_at = last_seen_before_cut = None
        for point in job.stream_metrics():
            arrivals.append((time.time(), point["step"]))
            if point["step"] == HOLD_AT:
                # The job waits here until the gate opens: this metric came while it ran.
                state_when_held = client.job(job.id).state
                wait_for(
                    lambda: any(
                        e.kind == "metrics" and e.data["step"] == HOLD_AT for e in followed
                    ),
                    timeout=30,
                    what="the relayed follower to see the held step",
                )
                last_seen_before_cut = followed[-1].seq
                cut_at = relay.cut()
                gate.touch()
        assert state_when_held == JobState.RUNNING
        assert [step for _, step in arrivals] == list(range(1, MAX_STEPS + 1))
        assert job.wait(timeout=180) == JobState.SUCCEEDED
        follower.join(timeout=60)
        relay.close()
        assert not follower.is_alive() and not follower_error, follower_error

        finished = job.info.finished_at
        assert finished is not None
        assert arrivals[HOLD_AT - 1][0] < finished.timestamp()

        stored = api_get(live, f"/v1/jobs/{job.id}/events", limit=5000)["items"]
        # The cut lost nothing and repeated nothing: the follower has the whole log, in order.
        assert [e.model_dump(mode="json") for e in followed] == stored
        assert stored[-1]["data"]["state"] == "succeeded"
        # ... because it came back asking for what came after the last event it had.
        assert cut_at is not None and last_seen_before_cut is not None
        resumed = [head for at, head in relay.requests if at > cut_at]
        assert resumed, "the follower did not reconnect"
        assert "last-event-id: " in resumed[0].lower(), resumed[0]
        resumed_from = int(resumed[0].lower().split("last-event-id: ")[1].split("\r\n")[0])
        assert last_seen_before_cut <= resumed_from < stored[-1]["seq"]
        # The service also asked it to reconnect (it fell behind the 2-event buffer while
        # the job reported its steps in bursts), and that resumed as exactly.
        assert relay.reconnects_asked >= 1

        # What the client returns is what the API returns.
        assert [e.model_dump(mode="json") for e in job.events()] == stored
        assert [e.model_dump(mode="json") for e in job.events(after=5, kinds=["state"])] == [
            e for e in stored if e["seq"] > 5 and e["kind"] == "state"
        ]
        checkpoints = api_get(live, f"/v1/jobs/{job.id}/checkpoints")["items"]
        assert [c.model_dump(mode="json") for c in job.checkpoints()] == checkpoints
        assert [c.step for c in job.checkpoints()] == [30, 40, 50]
        assert job.metrics(points=5).model_dump() == api_get(
            live, f"/v1/jobs/{job.id}/metrics", points=5
        )
        assert job.refresh().info.model_dump(mode="json") == api_get(live, f"/v1/jobs/{job.id}")
        assert job.id in [j.id for j in client.jobs(state="succeeded")]
        assert job.id not in [j.id for j in client.jobs(state=JobState.RUNNING)]


def test_logs_come_back_as_the_api_has_them(live: LiveServer) -> None:
    with jobs_ended(live), Client(live.url, TOKEN) as client:
        job = client.submit(chatty_job())
        followed = list(job.logs(follow=True))  # from submission to the job's end
        assert job.refresh().state == JobState.SUCCEEDED

        stored = api_get(live, f"/v1/jobs/{job.id}/logs", limit=5000)["items"]
        assert [line.model_dump(mode="json") for line in job.logs()] == stored
        assert followed == list(job.logs())
        rank_1 = list(job.logs(rank=1))
        assert rank_1 == [line for line in followed if line.rank == 1]
        assert ("stdout", "hello from rank 1") in [(x.stream, x.line) for x in rank_1]
        assert ("stderr", "rank 1 to stderr") in [(x.stream, x.line) for x in rank_1]

        with pytest.raises(Conflict) as e:
            job.cancel()
        assert e.value.status == 409
        assert str(e.value) == "the job is succeeded (409 Job already ended)"


def test_an_invalid_spec_fails_before_any_request() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with Client(url, "t", timeout=0.5) as client:
            with pytest.raises(ValidationError) as e:
                client.submit(small_job(learning_rate=-1))
            assert e.value.errors()[0]["loc"] == ("hyperparameters", "learning_rate")
            with pytest.raises(ValidationError):
                client.submit({**small_job(), "workload": "rm -rf /"})
            with pytest.raises(BlockingIOError):
                listener.accept()  # no connection was ever made

            async def submit_async() -> None:
                async with AsyncClient(url, "t", timeout=0.5) as aclient:
                    await aclient.submit(small_job(global_batch_size=0))

            with pytest.raises(ValidationError):
                asyncio.run(submit_async())
            with pytest.raises(BlockingIOError):
                listener.accept()

            # The probe can see a request: a valid one connects (and gets no answer here).
            with pytest.raises(ConnectionFailed, match=r"^could not reach http://127\.0\.0\.1"):
                client.submit(small_job())
            connection, _ = listener.accept()
            connection.close()


def test_refusals_are_typed_errors_naming_the_problem(live: LiveServer) -> None:
    with Client(live.url, TOKEN) as client:
        with pytest.raises(NotFound) as missing:
            client.job("job-nope")
        assert (missing.value.status, str(missing.value)) == (
            404,
            "no job 'job-nope' (404 Not found)",
        )
        # Refused by the service, not by the local check: the cluster could never hold it.
        spec = small_job()
        spec["scaling"] = {"min_workers": 8, "max_workers": 8}
        with pytest.raises(InvalidRequest) as refused:
            client.submit(spec)
        assert refused.value.status == 422
        assert [e.field for e in refused.value.errors] == ["scaling.min_workers"]
        assert str(refused.value).startswith("scaling.min_workers: min_workers is 8 but")

        with live.client() as admin:
            user_token = create_user_token(admin, "client-user")
    with Client(live.url, user_token) as user:
        # An ordinary user sees the service's default limits, which apply to them.
        assert user.me().model_dump() == {
            "user": "client-user",
            "role": "user",
            "limits": {
                "max_active_jobs": 10,
                "max_cpus": None,
                "max_gpus": None,
                "max_wall_time_s": 604800.0,
                "max_workers": None,
                "code_submission": True,
            },
        }
        with pytest.raises(Forbidden) as forbidden:
            user.request("GET", "/v1/users")
        assert forbidden.value.status == 403
        assert "(403 " in str(forbidden.value)
        # A priority above normal is an admin's: the spec is valid, the service refuses it.
        with pytest.raises(Forbidden) as above:
            user.submit({**small_job(), "priority": "high"})
        assert [(e.field, e.message) for e in above.value.errors] == [
            ("priority", "'high' is above normal (50); only an admin may submit a job above normal")
        ]
        assert user.jobs() == []
    with Client(live.url, "not-a-token") as stranger, pytest.raises(Unauthorized) as e:
        stranger.jobs()
    assert e.value.status == 401


def test_the_async_client_runs_the_readme_job(live: LiveServer) -> None:
    async def scenario() -> dict[str, Any]:
        async with AsyncClient(live.url, TOKEN) as client:
            job = await client.submit(small_job())
            points = [p async for p in job.stream_metrics()]
            final = await job.wait(timeout=180)
            return {
                "id": job.id,
                "points": points,
                "final": final,
                "info": (await job.refresh()).info.model_dump(mode="json"),
                "events": [e.model_dump(mode="json") async for e in job.events()],
                "followed": [e.model_dump(mode="json") async for e in job.events(follow=True)],
                "logs": [line.model_dump(mode="json") async for line in job.logs()],
                "checkpoints": [c.model_dump(mode="json") for c in await job.checkpoints()],
                "listed": [j.id for j in await client.jobs(state="succeeded")],
                "again": (await client.job(job.id)).state,
            }

    with jobs_ended(live):
        got = asyncio.run(scenario())
    job_id = got["id"]
    assert got["final"] == JobState.SUCCEEDED == got["again"]
    assert [p["step"] for p in got["points"]] == list(range(1, MAX_STEPS + 1))
    assert all(p["total_steps"] == MAX_STEPS and p["loss"] > 0 for p in got["points"])
    stored = api_get(live, f"/v1/jobs/{job_id}/events", limit=5000)["items"]
    assert got["events"] == got["followed"] == stored
    assert [p["time"] for p in got["points"]] == [
        datetime.fromisoformat(e["time"]) for e in stored if e["kind"] == "metrics"
    ]
    assert got["logs"] == api_get(live, f"/v1/jobs/{job_id}/logs")["items"]
    assert got["checkpoints"] == api_get(live, f"/v1/jobs/{job_id}/checkpoints")["items"]
    assert got["info"] == api_get(live, f"/v1/jobs/{job_id}")
    assert job_id in got["listed"]


def test_a_service_that_is_gone_is_one_line_naming_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with (
            Client(f"http://127.0.0.1:{port}", "t") as client,
            pytest.raises(ConnectionFailed) as e,
        ):
            client.jobs()
    assert str(e.value) == f"could not reach http://127.0.0.1:{port}: connection refused"
