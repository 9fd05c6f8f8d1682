"""Status streams back: SSE over a real uvicorn, read by a real HTTP client, with real Ray."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TOKEN, LiveServer, make_settings, small_job, wait_for

SSE = {"Accept": "text/event-stream"}


def iter_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Messages as {id, event, data} as they arrive (comments skipped)."""
    current: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if current:
                yield current
                current = {}
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(": ")
        current[field] = json.loads(value) if field == "data" else value


def parse_sse(lines: Iterator[str], stop_after: int | None = None) -> list[dict[str, Any]]:
    """The messages until the stream ends, or the first ``stop_after`` of them."""
    messages: list[dict[str, Any]] = []
    for message in iter_sse(lines):
        messages.append(message)
        if stop_after is not None and len(messages) >= stop_after:
            break
    return messages


def read_stream(
    server: LiveServer,
    path: str,
    headers: dict[str, str] | None = None,
    stop_after: int | None = None,
    arrivals: list[float] | None = None,
) -> list[dict[str, Any]]:
    """The stream's messages; ``arrivals`` gets the wall-clock time each one arrived."""
    with (
        server.client() as client,
        client.stream("GET", path, headers={**SSE, **(headers or {})}, timeout=300) as r,
    ):
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        messages: list[dict[str, Any]] = []
        for message in iter_sse(r.iter_lines()):
            if arrivals is not None:
                arrivals.append(time.time())
            messages.append(message)
            if stop_after is not None and len(messages) >= stop_after:
                break
        return messages


def full_log(server: LiveServer, job_id: str) -> list[dict[str, Any]]:
    with server.client() as client:
        return client.get(f"/v1/jobs/{job_id}/events", params={"limit": 5000}).json()["items"]


def test_a_client_sees_the_job_live_in_order(server: LiveServer) -> None:
    everything: list[dict[str, Any]] = []
    listening = threading.Event()

    def watch_all_jobs() -> None:
        with (
            server.client() as client,
            client.stream("GET", "/v1/events", headers=SSE, timeout=300) as r,
        ):
            listening.set()
            for message in iter_sse(r.iter_lines()):
                everything.append(message)
                if message["data"]["job"]["state"] == "succeeded":
                    return

    watcher = threading.Thread(target=watch_all_jobs, daemon=True)
    watcher.start()
    listening.wait(10)
    with server.client() as client:
        job = client.post("/v1/jobs", json=small_job(report_every_steps=5)).json()
    arrivals: list[float] = []
    messages = read_stream(server, f"/v1/jobs/{job['id']}/events", arrivals=arrivals)
    # Live, not replayed at the end: the first metrics reached this client before the job's
    # terminal event was even recorded (a server that held the stream back would fail this).
    timed = zip(arrivals, messages, strict=True)
    first_metrics_at = next(t for t, m in timed if m["event"] == "metrics")
    ended_at = datetime.fromisoformat(messages[-1]["data"]["time"]).timestamp()
    assert first_metrics_at < ended_at, (first_metrics_at, messages[-1])

    assert [int(m["id"]) for m in messages] == list(range(1, len(messages) + 1))
    assert [m["data"] for m in messages] == full_log(server, job["id"])
    assert all(m["event"] == m["data"]["kind"] for m in messages)
    states = [m["data"]["data"]["state"] for m in messages if m["event"] == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]
    assert messages[-1]["event"] == "state"  # the stream ends with the terminal event
    steps = [m["data"]["data"]["step"] for m in messages if m["event"] == "metrics"]
    assert steps == [1, *range(5, 51, 5)]
    running = next(
        i
        for i, m in enumerate(messages)
        if m["event"] == "state" and m["data"]["data"]["state"] == "running"
    )
    first_metrics = next(i for i, m in enumerate(messages) if m["event"] == "metrics")
    assert running < first_metrics

    watcher.join(30)
    mine = [
        (m["data"]["type"], m["data"]["job"]["state"])
        for m in everything
        if m["data"]["job"]["id"] == job["id"]
    ]
    assert mine == [
        ("created", "queued"),
        ("state", "starting"),
        ("state", "running"),
        ("state", "succeeded"),
    ]


def test_reconnecting_and_an_api_restart_lose_nothing(ray_cluster: Any, tmp_path: Path) -> None:
    with LiveServer(make_settings(tmp_path)) as first:
        with first.client() as client:
            job = client.post(
                "/v1/jobs", json=small_job(max_steps=600, report_every_steps=10)
            ).json()
        part1 = read_stream(first, f"/v1/jobs/{job['id']}/events", stop_after=3)
        # A reconnect by Last-Event-ID picks up exactly where the first read stopped.
        part2 = read_stream(
            first,
            f"/v1/jobs/{job['id']}/events",
            headers={"Last-Event-ID": part1[-1]["id"]},
            stop_after=4,
        )
        wait_for(
            lambda: any(e["kind"] == "metrics" for e in full_log(first, job["id"])),
            120,
            what="the first metrics",
        )
    down_from = time.time()
    time.sleep(3)  # the API is down; the job trains on and its supervisor keeps the events
    with LiveServer(make_settings(tmp_path)) as second:
        part3 = read_stream(
            second, f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": part2[-1]["id"]}
        )
        log = full_log(second, job["id"])
    received = [m["data"] for m in part1 + part2 + part3]
    assert received == log
    assert log[-1]["data"]["state"] == "succeeded"
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    made = [datetime.fromisoformat(e["time"]).timestamp() for e in log]
    assert any(down_from < t < down_from + 3 for t in made)  # made while it was down


@pytest.fixture
def wide_server(ray_cluster: Any, tmp_path: Path) -> Iterator[LiveServer]:
    # One token opens every stream here: allow it a hundred (the default cap is lower).
    with LiveServer(make_settings(tmp_path, max_streams_per_token=110)) as live:
        yield live


def test_a_hundred_clients_all_get_the_whole_stream(wide_server: LiveServer) -> None:
    server = wide_server
    with server.client() as client:
        job = client.post("/v1/jobs", json=small_job(max_steps=200, report_every_steps=2)).json()

    async def one(client: httpx.AsyncClient) -> list[int]:
        async with client.stream("GET", f"/v1/jobs/{job['id']}/events", headers=SSE) as r:
            ids = []
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
            return ids

    async def all_of_them() -> list[list[int]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=server.url,
            limits=limits,
            timeout=300,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as client:
            return await asyncio.gather(*(one(client) for _ in range(100)))

    results = asyncio.run(all_of_them())
    log = full_log(server, job["id"])
    assert log[-1]["data"]["state"] == "succeeded"
    expected = [e["seq"] for e in log]
    assert all(ids == expected for ids in results)
    assert len(results) == 100


def test_keepalives_and_a_client_behind_told_to_reconnect(ray_cluster: Any, tmp_path: Path) -> None:
    # A lag of 5 events is "too far behind" here, and the service collects the job's events
    # once a second: each collection is a burst of a second's metrics (a step's each), which
    # cuts readers off, and between bursts a stream is quiet for longer than its keep-alive.
    settings = make_settings(
        tmp_path, sse_keepalive_s=0.5, sse_client_buffer=5, event_poll_interval_s=1.0
    )
    with LiveServer(settings) as live, live.client() as client:
        job = client.post("/v1/jobs", json=small_job(max_steps=300)).json()
        received: list[dict[str, Any]] = []
        reconnects, keepalives, last = 0, 0, "0"
        while True:
            # Resume both ways the README offers, in turn: Last-Event-ID, then ?after=N.
            by_header = reconnects % 2 == 0
            with client.stream(
                "GET",
                f"/v1/jobs/{job['id']}/events",
                timeout=300,
                headers={**SSE, "Last-Event-ID": last} if by_header else SSE,
                params={} if by_header else {"after": last},
            ) as r:
                lines = list(r.iter_lines())
            keepalives += lines.count(": keep-alive")
            messages = parse_sse(iter(lines))
            if messages:
                # Each connection starts right after where the last one stopped.
                assert int(messages[0]["id"]) == int(last) + 1, (by_header, last, messages[0])
            if messages and messages[-1]["event"] == "reconnect":
                reconnects += 1
                told = str(messages[-1]["data"]["last_event_id"])
                # The last event delivered, or (none delivered) the one the client gave.
                assert told == (messages[-2]["id"] if len(messages) > 1 else last)
                last = told
                received += [m["data"] for m in messages[:-1]]
                continue
            received += [m["data"] for m in messages]
            break
        assert keepalives > 0  # quiet between collections: the stream said it was alive
        assert reconnects > 1  # both ways of resuming were used
        assert received == full_log(live, job["id"])
        assert received[-1]["data"]["state"] == "succeeded"


def test_metrics_come_back_as_columns_and_downsampled(server: LiveServer) -> None:
    with server.client() as client:
        job = client.post("/v1/jobs", json=small_job(max_steps=50)).json()
        wait_for(
            lambda: client.get(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded",
            180,
            what="succeeded",
        )
        full = client.get(f"/v1/jobs/{job['id']}/metrics").json()
        assert full["total_points"] == 50
        cols = full["columns"]
        assert set(cols) == {
            "step",
            "time",
            "loss",
            "accuracy",
            "samples_per_s",
            "learning_rate",
            "world_size",
        }
        assert cols["step"] == list(range(1, 51))
        assert set(cols["world_size"]) == {2} and set(cols["learning_rate"]) == {0.05}
        assert all(len(v) == 50 for v in cols.values())
        assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"every": 10}).json()["columns"][
            "step"
        ] == [1, 11, 21, 31, 41, 50]
        assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"points": 5}).json()["columns"][
            "step"
        ] == [1, 11, 21, 31, 41, 50]
        both = client.get(f"/v1/jobs/{job['id']}/metrics", params={"every": 2, "points": 5})
        assert both.status_code == 400


def test_what_workers_print_reaches_the_logs(ray_cluster: Any, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, entrypoint_modules=["tests.workloads"])
    with LiveServer(settings) as live, live.client() as client:
        spec = {
            "name": "chatty",
            "workload": "tests.workloads.chatty:train_loop",
            "hyperparameters": {"steps": 3},
            "scaling": {"min_workers": 2, "max_workers": 2},
        }
        r = client.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job = r.json()
        followed = read_stream(live, f"/v1/jobs/{job['id']}/logs?follow=true")
        assert client.get(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded"
        lines = client.get(f"/v1/jobs/{job['id']}/logs").json()["items"]

    by_rank = {(entry["rank"], entry["stream"], entry["line"]) for entry in lines}
    for rank in (0, 1):
        assert (rank, "stdout", f"hello from rank {rank}") in by_rank
        assert (rank, "stderr", f"rank {rank} to stderr") in by_rank
        assert (rank, "stderr", f"rank {rank} logs a warning") in by_rank
        assert (rank, "stdout", f"rank {rank} step 2") in by_rank
        assert any(
            s == "stderr" and f"UserWarning: rank {rank} warns" in t
            for r_, s, t in by_rank
            if r_ == rank
        )
    assert all(entry["attempt"] == 1 for entry in lines)
    assert {m["event"] for m in followed} == {"log"}
    followed_lines = {
        (m["data"]["data"]["rank"], line[2])
        for m in followed
        for line in m["data"]["data"]["lines"]
    }
    assert (1, "hello from rank 1") in followed_lines


@pytest.mark.parametrize(
    "path", ["/v1/events", "/v1/jobs/job-x/events", "/v1/jobs/job-x/logs", "/v1/jobs/job-x/metrics"]
)
def test_streams_need_the_token(server: LiveServer, path: str) -> None:
    with server.client(token=None) as client:
        assert client.get(path, headers=SSE).status_code == 401
