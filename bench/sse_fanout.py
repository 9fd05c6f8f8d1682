"""Does watching a job slow it down? The same job, with no SSE client and with 100.

Starts the service (`etrain serve`, the embedded default, in its own process), runs the
small-CNN job once unwatched and once with 100 concurrent clients streaming its events,
and prints the steady-state samples/s of each and their ratio (goal: at least 0.95). Every
client must get the job's whole event log, message for message, in order.

    .venv/bin/python -m bench.sse_fanout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

TOKEN = "bench-token"
STEPS = 1500
CLIENTS = 100
ROUNDS = 3
EVENTS_PAGE = 5000  # the most events the API gives in one page


def job_spec() -> dict[str, Any]:
    return {
        "name": "fanout",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "max_steps": STEPS,
            "global_batch_size": 64,
            "learning_rate": 0.05,
            "seed": 0,
            "report_every_steps": 10,
        },
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 100, "keep": 2},
    }


async def watch(client: httpx.AsyncClient, job_id: str) -> list[tuple[str, str]]:
    """Every (id, data) message the client got, in order."""
    got: list[tuple[str, str]] = []
    event_id = ""
    async with client.stream(
        "GET", f"/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream"}
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                got.append((event_id, line[6:]))
    return got


async def whole_log(client: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    """The job's whole event log, a page of the API's largest size at a time."""
    log: list[dict[str, Any]] = []
    while True:
        after = log[-1]["seq"] if log else 0
        params = {"after": after, "limit": EVENTS_PAGE}
        page = (await client.get(f"/v1/jobs/{job_id}/events", params=params)).json()["items"]
        log += page
        if len(page) < EVENTS_PAGE:
            return log


async def run_job(base: str, clients: int) -> tuple[float, int]:
    """The job's steady samples/s, and how many events each watcher got. Every watcher must
    have got the whole log, exactly as the job's event log holds it, in order: a fan-out
    that dropped, repeated or reordered a message would otherwise pass on its count."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(
        base_url=base,
        headers=headers,
        timeout=600,
        limits=httpx.Limits(max_connections=clients + 10),
    ) as client:
        job = (await client.post("/v1/jobs", json=job_spec())).json()
        watchers = [asyncio.create_task(watch(client, job["id"])) for _ in range(clients)]
        while (await client.get(f"/v1/jobs/{job['id']}")).json()["state"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            await asyncio.sleep(0.5)
        streams = list(await asyncio.gather(*watchers))
        metrics = (await client.get(f"/v1/jobs/{job['id']}/metrics")).json()["columns"]
        log = await whole_log(client, job["id"])
    expected = [(str(e["seq"]), e) for e in log]
    for number, got in enumerate(streams):
        assert [(i, json.loads(d)) for i, d in got] == expected, (
            f"client {number} did not get the whole log in order "
            f"({len(got)} messages, the log has {len(expected)})"
        )
    # Steady state: past the first 100 steps (warm-up, first checkpoint).
    rates = [
        r for s, r in zip(metrics["step"], metrics["samples_per_s"], strict=True) if s > 100 and r
    ]
    return statistics.median(rates), len(expected)


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    data = tempfile.mkdtemp(prefix="etrain-bench-")
    port = 8765
    env = {
        **os.environ,
        "ETRAIN_DATA_DIR": data,
        "ETRAIN_API_TOKEN": TOKEN,
        "ETRAIN_PORT": str(port),
        "ETRAIN_LOG_LEVEL": "warning",
        # One token watches with every client here: allow it that many streams.
        "ETRAIN_MAX_STREAMS_PER_TOKEN": str(CLIENTS + 10),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the service did not become ready")
            time.sleep(0.5)
        # A warm-up run (cold caches make the first run slow), then alternate the two:
        # run-to-run noise on 2 cores is several percent.
        asyncio.run(run_job(base, 0))
        alone_runs, watched_runs, counts = [], [], []
        for _ in range(ROUNDS):
            alone_runs.append(asyncio.run(run_job(base, 0))[0])
            rate, events = asyncio.run(run_job(base, CLIENTS))
            watched_runs.append(rate)
            counts.append(events)
        alone, watched = statistics.mean(alone_runs), statistics.mean(watched_runs)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(
        "unwatched runs:",
        [round(r) for r in alone_runs],
        "watched runs:",
        [round(r) for r in watched_runs],
    )
    print()
    print("| run                       | samples/s (mean of medians) | events per client |")
    print("| ------------------------- | --------------------------- | ----------------- |")
    print(f"| no SSE client             | {alone:27.0f} | {'-':>17} |")
    # Each of the CLIENTS watchers got the whole log of its run (checked in run_job).
    print(f"| {CLIENTS} SSE clients on the job | {watched:27.0f} | {min(counts):17d} |")
    print(f"\nratio watched/unwatched: {watched / alone:.3f}")


if __name__ == "__main__":
    main()
