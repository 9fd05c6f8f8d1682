"""A queued job costs a row, not a process: on a real Ray cluster through the real service,
1 000 jobs queued behind one that holds the whole pool start no process and add little
memory; each waits in the scheduler's queue in order, saying why; and the first in line
starts, with a supervisor of its own, once the pool is free."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from ray.util.state import list_actors, list_workers

from elastic.warm_processes import IDLE_BEFORE_S, REPLACE_AFTER_S
from tests.conftest import (
    POOL_SIZE,
    ClusterPool,
    LiveServer,
    all_events,
    make_settings,
    small_job,
    state_address,
    wait_for,
    wait_until_ended,
)

QUEUED = 1000
# What 1 000 rows may add to the head's memory: the service's rows and the scheduler's book.
MAX_GROWTH_MB = 200.0


def _rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0.0  # it ended between the listing and the read
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _head() -> tuple[int, float]:
    """(live Ray worker processes of this cluster, the memory in MB of this cluster's
    processes and of this process, which runs the service)."""
    address = state_address()
    # Filtered here: Ray's filters apply after its limit on what it fetches.
    workers = [w for w in list_workers(address=address, limit=10_000) if w["is_alive"]]
    found = subprocess.run(
        ["pgrep", "-f", f"(raylet|gcs_server) .*{address.split(':')[-1]}"],
        capture_output=True,
        text=True,
    )
    pids = {int(w["pid"]) for w in workers} | {int(p) for p in found.stdout.split()}
    pids.add(int(Path("/proc/self").resolve().name))
    return len(workers), sum(_rss_mb(pid) for pid in pids)


def _settled_head(timeout_s: float = 90.0) -> tuple[int, float]:
    """``_head()`` once no process comes or grows: the nodes' ready processes that replace
    those a job just took start seconds after it did, once their node has had a CPU free
    for a while, then import torch (elastic/warm_processes.py)."""
    time.sleep(max(REPLACE_AFTER_S, IDLE_BEFORE_S) + 1.0)
    deadline = time.monotonic() + timeout_s
    last = _head()
    while True:
        time.sleep(2.0)
        now = _head()
        if now[0] == last[0] and abs(now[1] - last[1]) < 10.0:
            return now
        assert time.monotonic() < deadline, f"the processes never settled: {last} -> {now}"
        last = now


def _supervisors() -> list[str]:
    actors = list_actors(address=state_address(), limit=10_000)
    return sorted(
        a["name"] for a in actors if a["class_name"] == "Supervisor" and a["state"] == "ALIVE"
    )


def get(api: httpx.Client, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = api.get(f"/v1/jobs/{job_id}").json()
    return job


def _submit(api: httpx.Client, spec: dict[str, Any]) -> str:
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_a_thousand_queued_jobs_start_no_process_and_wait_in_order(
    ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    settings = make_settings(tmp_path, user_max_active_jobs=QUEUED + 1)
    whole_pool = {"min_workers": POOL_SIZE, "max_workers": POOL_SIZE, "cpus_per_worker": 1}
    with LiveServer(settings) as server, server.client() as api:
        blocker = _submit(api, {**small_job(max_steps=1_000_000), "scaling": whole_pool})
        wait_for(lambda: get(api, blocker)["state"] == "running", 120, what="the blocker running")
        assert _supervisors() == [f"etrain-supervisor-{blocker}"]
        processes_before, memory_before = _settled_head()

        queued = []
        for i in range(QUEUED):
            spec = {**small_job(max_steps=4), "name": f"q{i}", "scaling": whole_pool}
            queued.append(_submit(api, spec))

        def whole_queue() -> dict[str, Any] | None:
            """Every page, in order (a page of 100 by default), while nothing moves."""
            view: dict[str, Any] = api.get("/v1/queue").json()
            if view["waiting"] != QUEUED:
                return None
            pages = [view]
            while pages[-1]["next_after_position"] is not None:
                after = pages[-1]["next_after_position"]
                pages.append(api.get("/v1/queue", params={"after_position": after}).json())
            assert [len(p["queue"]) for p in pages] == [100] * (QUEUED // 100)
            return {**view, "queue": [e for p in pages for e in p["queue"]]}

        view = wait_for(whole_queue, 60, what="every queued job in the scheduler's queue")
        # In order of submission, each with the scheduler's reason.
        assert [e["job_id"] for e in view["queue"]] == queued
        assert [e["position"] for e in view["queue"]] == list(range(1, QUEUED + 1))
        assert view["queue"][0]["reason"] == f"waiting: only 0 of {POOL_SIZE} workers free"
        assert [r["job_id"] for r in view["running"]] == [blocker]

        # No process for any of them, and little memory.
        processes_after, memory_after = _head()
        assert _supervisors() == [f"etrain-supervisor-{blocker}"]
        assert processes_after == processes_before
        assert memory_after - memory_before < MAX_GROWTH_MB, (memory_before, memory_after)

        # Each says why it waits in its own log, written by the service.
        first = queued[0]
        wait_for(
            lambda: [e["kind"] for e in all_events(api, first)] == ["state", "waiting"],
            30,
            what="the first queued job's reason in its log",
        )
        assert all_events(api, first)[1]["data"] == {"reason": view["queue"][0]["reason"]}

        # A cancelled row leaves the queue at once and never starts.
        second = queued[1]
        assert api.post(f"/v1/jobs/{second}/cancel").json()["state"] == "cancelled"
        wait_for(
            lambda: (
                second not in {e["job_id"] for e in api.get("/v1/queue").json()["queue"]}
                and api.get("/v1/queue").json()["waiting"] == QUEUED - 1
            ),
            10,
            what="the cancelled job off the queue",
        )

        # The pool frees: the first in line gets its supervisor, runs and succeeds; the next
        # ones wait behind it, still as rows.
        api.post(f"/v1/jobs/{blocker}/cancel")
        done = wait_until_ended(api, first, timeout=180)
        assert done["state"] == "succeeded", done
        assert get(api, second)["state"] == "cancelled"
        states = [e["data"]["state"] for e in all_events(api, first, "state")]
        assert states == ["queued", "starting", "running", "succeeded"]
        third = wait_for(
            lambda: get(api, queued[2]) if get(api, queued[2])["state"] != "queued" else None,
            120,
            what="the next in line starting",
        )
        assert third["state"] in ("starting", "running", "succeeded")
        assert all(get(api, job)["state"] == "queued" for job in queued[4:10])
        assert len(_supervisors()) <= 1
