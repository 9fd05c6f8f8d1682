"""How fast does the API answer under a steady mixed load, with 1 000 jobs in its store?

Starts the service (`etrain serve`, the embedded default, in its own process, SQLite) on a
store seeded with 1 000 finished jobs, then for a fixed time sends requests at a fixed rate
(open loop: a slow answer does not slow the sender): reads of one job, pages of the job
list, and a few submissions of a tiny job (cancelled at the end). Prints p50/p99 latency and
errors per kind. Target: p99 under 50 ms for reads, zero errors. Loopback only.

    .venv/bin/python -m bench.api_load [--seconds 30] [--rate 40] [--submit-every 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TOKEN = "bench-token"
SEEDED = 1000


def tiny_job(i: int) -> dict[str, Any]:
    return {
        "name": f"load-{i}",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "max_steps": 5,
            "global_batch_size": 16,
            "learning_rate": 0.05,
            "seed": i,
        },
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 100, "keep": 1},
    }


def seed_store(data_dir: Path) -> list[str]:
    """1 000 finished jobs, each with its queued/succeeded events, straight into the store."""
    from service.store import Store

    store = Store(f"sqlite:///{(data_dir / 'etrain.db').resolve()}")
    ids = []
    for i in range(SEEDED):
        job = store.create_job(f"seeded-{i}", "admin", "image-classification", tiny_job(i))
        store.append_events(
            job.id,
            [{"seq": 2, "kind": "state", "time": time.time(), "data": {"state": "cancelled"}}],
        )
        ids.append(job.id)
    store.close()
    return ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def load(
    base: str, ids: list[str], seconds: float, rate: float, submit_every: float
) -> dict[str, tuple[list[float], int]]:
    results: dict[str, tuple[list[float], int]] = {
        "get": ([], 0),
        "list": ([], 0),
        "submit": ([], 0),
    }
    submitted: list[str] = []
    rng = random.Random(0)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def one(client: httpx.AsyncClient, kind: str, i: int) -> None:
        start = time.perf_counter()
        try:
            if kind == "get":
                r = await client.get(f"/v1/jobs/{rng.choice(ids)}")
            elif kind == "list":
                r = await client.get("/v1/jobs", params={"limit": 50})
            else:
                r = await client.post("/v1/jobs", json=tiny_job(i))
                if r.status_code == 201:
                    submitted.append(r.json()["id"])
            ok = r.status_code in (200, 201)
        except httpx.HTTPError:
            ok = False
        latencies, errors = results[kind]
        latencies.append(time.perf_counter() - start)
        results[kind] = (latencies, errors + (not ok))

    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=30, limits=httpx.Limits(max_connections=200)
    ) as client:
        tasks = []
        t0 = time.perf_counter()
        i, next_submit = 0, 0.0
        while (now := time.perf_counter() - t0) < seconds:
            if now >= next_submit:
                tasks.append(asyncio.create_task(one(client, "submit", i)))
                next_submit += submit_every
            kind = "get" if rng.random() < 0.7 else "list"
            tasks.append(asyncio.create_task(one(client, kind, i)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        await asyncio.gather(*tasks)
        for job_id in submitted:
            await client.post(f"/v1/jobs/{job_id}/cancel")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rate", type=float, default=40, help="reads a second")
    parser.add_argument("--submit-every", type=float, default=3, help="seconds between submits")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="etrain-load-") as data:
        ids = seed_store(Path(data))
        base = f"http://127.0.0.1:{args.port}"
        env = {
            **os.environ,
            "ETRAIN_DATA_DIR": data,
            "ETRAIN_API_TOKEN": TOKEN,
            "ETRAIN_PORT": str(args.port),
            "ETRAIN_LOG_LEVEL": "warning",
            "ETRAIN_RATE_LIMIT_PER_S": "0",
            # It measures latency, not limits: its submissions never wait for a slot.
            "ETRAIN_USER_MAX_ACTIVE_JOBS": "100000",
            "ETRAIN_RAY_NUM_CPUS": "2",
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get(f"{base}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the service did not start")
                time.sleep(0.5)
            results = asyncio.run(load(base, ids, args.seconds, args.rate, args.submit_every))
        finally:
            server.terminate()
            server.wait(60)

    print(
        f"{args.seconds:.0f} s, {args.rate:.0f} reads/s (70% one job, 30% a page of 50), "
        f"a submit every {args.submit_every:.0f} s, {SEEDED} jobs in the store"
    )
    print(f"| {'request':<28} | {'count':>5} | {'p50 ms':>7} | {'p99 ms':>7} | {'errors':>6} |")
    print(f"| {'-' * 28} | {'-' * 5}: | {'-' * 6}: | {'-' * 6}: | {'-' * 5}: |")
    names = {"get": "GET /v1/jobs/{id}", "list": "GET /v1/jobs?limit=50", "submit": "POST /v1/jobs"}
    for kind, (latencies, errors) in results.items():
        if latencies:
            print(
                f"| {names[kind]:<28} | {len(latencies):>5} | "
                f"{statistics.median(latencies) * 1000:>7.1f} | "
                f"{percentile(latencies, 0.99) * 1000:>7.1f} | {errors:>6} |"
            )


if __name__ == "__main__":
    main()
