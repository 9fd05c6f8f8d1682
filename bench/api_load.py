"""How fast does the API answer with 10 000 jobs in its store and 50 clients at once?

Starts the service (`etrain serve`, its own process) on a store (SQLite, or the PostgreSQL
of --database-url, in a schema of its own) seeded with 10 000 finished jobs, then runs 50
concurrent clients, each sending one request a second on its own clock (open loop: a slow
answer does not delay the next, as a dashboard's timer does not), through a shuffled, fixed
list of requests: reads of one job, pages of 50 of the job list,
and submissions of a tiny job (each cancelled by its client right after, untimed, so the
cluster never fills). Prints p50/p99/max latency and errors per kind, with the sample count:
a p99 is printed only from 100 samples or more (below that it is the maximum in disguise).
Target: p99 under 50 ms for every kind, zero errors; each error is printed with its cause
(an error is a failure, not noise). Loopback only.

    .venv/bin/python -m bench.api_load [--database-url postgresql+psycopg://...]
        [--jobs 10000] [--clients 50] [--rate 1] [--reads 6000] [--pages 3000] [--submits 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from tests.pg_schema import scratch_schema

TOKEN = "bench-token"
MIN_SAMPLES_FOR_P99 = 100


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


def seed_store(url: str, count: int) -> list[str]:
    """``count`` finished jobs (each with its two state events), in one bulk insert through
    the store's own tables: what a service that ran them would hold."""
    from sqlalchemy import insert

    from jobs.spec import JobSpec
    from service.store import EventRow, JobRow, Store, new_job_id

    store = Store(url)
    start = datetime.now(UTC) - timedelta(days=1)
    jobs: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for i in range(count):
        at = start + timedelta(seconds=i)
        job_id = new_job_id()
        spec = JobSpec.model_validate(tiny_job(i)).model_dump(mode="json")
        jobs.append(
            {
                "id": job_id,
                "name": f"seeded-{i}",
                "owner": "admin",
                "workload": "image-classification",
                "spec": spec,
                "state": "cancelled",
                "message": "cancelled by the user",
                "world_size": 0,
                "step": 0,
                "restarts": 0,
                "last_seq": 2,
                "created_at": at,
                "updated_at": at,
                "finished_at": at,
            }
        )
        for seq, state in ((1, "queued"), (2, "cancelled")):
            data = {"state": state, "previous": None, "reason": None}
            events.append(
                {
                    "job_id": job_id,
                    "seq": seq,
                    "kind": "state",
                    "time": at.timestamp(),
                    "data": data,
                }
            )
    with store.session() as s:
        s.execute(insert(JobRow), jobs)
        s.execute(insert(EventRow), events)
    store.close()
    return [str(j["id"]) for j in jobs]


@contextmanager
def database(url: str | None, data_dir: Path) -> Iterator[str]:
    """The store's URL: a SQLite file in ``data_dir``, or a fresh schema (dropped after) on
    the PostgreSQL of ``url``."""
    if url is None:
        yield f"sqlite:///{(data_dir / 'etrain.db').resolve()}"
        return
    with scratch_schema(url, "etrain_bench") as scoped:
        yield scoped


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))]


async def load(
    base: str,
    ids: list[str],
    plan: list[str],
    clients: int,
    rate: float,
    trace: list[tuple[float, str, float]] | None = None,
    failures: list[tuple[float, str, float, str]] | None = None,
) -> tuple[dict[str, tuple[list[float], int]], float]:
    """``clients`` clients, each sending ``rate`` requests a second on its own schedule (open
    loop: a slow answer does not delay its next request, as a dashboard's timer does not),
    from one shared, shuffled plan. Returns the results and when the first client was due
    (the clock of ``trace``'s and ``failures``' start times)."""
    results: dict[str, tuple[list[float], int]] = {k: ([], 0) for k in ("get", "list", "submit")}
    failed = [] if failures is None else failures
    rng = random.Random(1)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    work = iter(enumerate(plan))

    async def one(client: httpx.AsyncClient, i: int, kind: str) -> None:
        start = time.perf_counter()
        job_id = None
        why = None
        try:
            if kind == "get":
                r = await client.get(f"/v1/jobs/{rng.choice(ids)}")
            elif kind == "list":
                r = await client.get("/v1/jobs", params={"limit": 50})
            else:
                r = await client.post("/v1/jobs", json=tiny_job(i))
                if r.status_code == 201:
                    job_id = r.json()["id"]
            ok = r.status_code in (200, 201)
            if not ok:
                why = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            ok = False
            why = f"{type(e).__name__} {e}"[:200]
        elapsed = time.perf_counter() - start
        if trace is not None:
            trace.append((start, kind, elapsed))
        latencies, errors = results[kind]
        latencies.append(elapsed)
        results[kind] = (latencies, errors + (not ok))
        if why is not None:
            failed.append((start, kind, elapsed, why))
        if job_id is not None:  # untimed: keeps the cluster from filling with tiny jobs
            try:
                r = await client.post(f"/v1/jobs/{job_id}/cancel")
                why = None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__} {e}"[:200]
            if why is not None:
                failed.append((start, "cancel", 0.0, why))

    async def client_loop(number: int, client: httpx.AsyncClient, begin: float) -> None:
        # Clients start spread over one period, not all at the same instant.
        due = begin + number / (clients * rate)
        pending = []
        for i, kind in work:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            pending.append(asyncio.create_task(one(client, i, kind)))
            due += 1 / rate
        await asyncio.gather(*pending)

    # Every client is made before the first is due: making one takes ~20 ms here (its SSL
    # context), so clients made on their way to their first request were all late, and
    # fired their first requests together, a burst of ~40 at 1 s (the spread above undone).
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
    async with contextlib.AsyncExitStack() as stack:
        made = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=base, headers=headers, timeout=60, limits=limits)
            )
            for _ in range(clients)
        ]
        begin = time.perf_counter()
        await asyncio.gather(*(client_loop(n, c, begin) for n, c in enumerate(made)))
    return results, begin


@contextmanager
def client_pauses() -> Iterator[list[float]]:
    """The seconds each of this process's own full garbage collections took meanwhile: a
    pause of the clients' event loop is counted in every request it holds up, as if the
    service were slow. What the process holds before the load (the seeded ids, the plan)
    is frozen out of the collections (a 70 ms pause at the same moment of every run held
    up the requests due in it, the service idle)."""
    pauses: list[float] = []
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.collect()
    gc.freeze()
    gc.callbacks.append(timed)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timed)
        gc.unfreeze()


def serve(settings: dict[str, str]) -> subprocess.Popen[bytes]:
    """`etrain serve` in a process of its own, quiet, on its embedded Ray with 2 CPUs, with
    no rate limit (a bench measures the service, not its limits) and these settings."""
    env = {
        **os.environ,
        "ETRAIN_API_TOKEN": TOKEN,
        "ETRAIN_LOG_LEVEL": "warning",
        "ETRAIN_RATE_LIMIT_PER_S": "0",
        "ETRAIN_RAY_NUM_CPUS": "2",
        **settings,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_ready(base: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("the service did not start")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", help="PostgreSQL base URL; default: SQLite")
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs seeded in the store")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1.0, help="requests a second per client")
    parser.add_argument("--reads", type=int, default=6000, help="GET /v1/jobs/{id}")
    parser.add_argument("--pages", type=int, default=3000, help="GET /v1/jobs?limit=50")
    parser.add_argument("--submits", type=int, default=300, help="POST /v1/jobs")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--trace", type=Path, help="write each request's start, kind, ms")
    parser.add_argument("--hold", action="store_true", help="keep serving after (profiling)")
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="etrain-load-") as data,
        database(args.database_url, Path(data)) as url,
    ):
        seeded_at = time.perf_counter()
        ids = seed_store(url, args.jobs)
        seeded_s = time.perf_counter() - seeded_at
        base = f"http://127.0.0.1:{args.port}"
        server = serve(
            {
                "ETRAIN_DATA_DIR": data,
                "ETRAIN_DATABASE_URL": url,
                "ETRAIN_PORT": str(args.port),
                # It measures latency, not limits: its submissions never wait for a slot.
                "ETRAIN_USER_MAX_ACTIVE_JOBS": "100000",
            }
        )
        try:
            wait_ready(base, server)
            plan = ["get"] * args.reads + ["list"] * args.pages + ["submit"] * args.submits
            random.Random(0).shuffle(plan)
            ran_at = time.perf_counter()
            trace: list[tuple[float, str, float]] = []
            failures: list[tuple[float, str, float, str]] = []
            with client_pauses() as pauses:
                results, began = asyncio.run(
                    load(base, ids, plan, args.clients, args.rate, trace, failures)
                )
            if args.trace is not None:
                args.trace.write_text(
                    "".join(f"{t - began:.3f} {k} {ms * 1000:.1f}\n" for t, k, ms in trace)
                )
            ran_s = time.perf_counter() - ran_at
            if args.hold:
                input("serving; press Enter to stop ")
        finally:
            server.terminate()
            server.wait(60)

    backend = "PostgreSQL" if args.database_url else "SQLite"
    print(
        f"{backend}, {args.jobs} jobs in the store (seeded in {seeded_s:.0f} s), "
        f"{args.clients} concurrent clients at {args.rate:g} request/s each (open loop), "
        f"{len(plan)} requests in {ran_s:.0f} s"
    )
    print(
        f"| {'request':<24} | {'n':>5} | {'p50 ms':>7} | {'p99 ms':>7} | {'max ms':>7} | errors |"
    )
    print(f"| {'-' * 24} | {'-' * 4}: | {'-' * 6}: | {'-' * 6}: | {'-' * 6}: | -----: |")
    names = {"get": "GET /v1/jobs/{id}", "list": "GET /v1/jobs?limit=50", "submit": "POST /v1/jobs"}
    for kind, (latencies, errors) in results.items():
        if not latencies:
            continue
        p99 = (
            f"{percentile(latencies, 0.99) * 1000:>7.1f}"
            if len(latencies) >= MIN_SAMPLES_FOR_P99
            else f"{'n/a':>7}"
        )
        print(
            f"| {names[kind]:<24} | {len(latencies):>5} | "
            f"{statistics.median(latencies) * 1000:>7.1f} | {p99} | "
            f"{max(latencies) * 1000:>7.1f} | {errors:>6} |"
        )
    if pauses:
        print(
            f"the clients' own full garbage collections: {len(pauses)}, "
            f"longest {max(pauses) * 1000:.1f} ms"
        )
    # An error is a failure, not noise: say what each one was (the cancels, untimed, too).
    for start, kind, elapsed, why in sorted(failures):
        print(f"error: {start - began:.3f} s {kind} after {elapsed * 1000:.1f} ms: {why}")


if __name__ == "__main__":
    main()
