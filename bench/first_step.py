"""How long from a job's submission to its first step, on a warm cluster?

The README's job (`examples/job.yaml`: the small CNN, 2 workers, in place) submitted to
`etrain serve` (its embedded Ray with 2 CPUs, SQLite) after one earlier job of the same kind
ran to its end there, timed from its `POST /v1/jobs` to the end of its first step (the
step-1 metrics event). Two sides of the service, each a fresh `etrain serve` per repetition:

- **pool**: each node keeps ready processes with torch imported
  (`ETRAIN_WARM_PROCESSES_PER_NODE=2`); the job's supervisor and workers start in them;
- **no pool**: `ETRAIN_WARM_PROCESSES_PER_NODE=0`, the default for now; each worker starts
  a process and imports torch.

and **torchrun** launching a 2-process DDP loop of the same model on the same synthetic data
(`bench/throughput.py`'s loop), from its launch to the end of its first step. The sides run
interleaved, --repeat times each; the table gives the median and the range, and the ratios
to torchrun. For the service's sides it also splits the time at the first attempt's start
(the `attempt_started` event: the supervisor is up and the workers' places are held); the
rest is the workers' start, their process group and the step. Target: the pool's median
within 1 s, under a third of torchrun's launch.

    .venv/bin/python -m bench.first_step [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.api_load import TOKEN, serve, wait_ready
from bench.control_plane import first_step_at, steady
from bench.throughput import run_torchrun
from elastic.warm_processes import Kind, pool_sizes
from tests.processes import process_tree, ready_to_train

README_JOB = Path(__file__).resolve().parent.parent / "examples" / "job.yaml"
SIDES = {"pool": "2", "no pool": "0"}


def wait_ended(api: httpx.Client, job_id: str, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = str(api.get(f"/v1/jobs/{job_id}").json()["state"])
        if state in ("succeeded", "failed", "cancelled"):
            return state
        time.sleep(0.2)
    raise SystemExit(f"{job_id} did not end within {timeout_s:.0f} s")


def attempt_started_at(api: httpx.Client, job_id: str) -> float:
    """When the job's supervisor began its first attempt (its workers asked for), Unix
    seconds."""
    page = api.get(f"/v1/jobs/{job_id}/events", params={"kind": "attempt_started", "limit": 1})
    return datetime.fromisoformat(page.json()["items"][0]["time"]).timestamp()


def pools_full(root: int, per_node: int, timeout_s: float = 120.0) -> None:
    """Until the embedded node (all this machine's cores) keeps ``per_node`` processes
    ready to train, among those under ``root``."""
    want = pool_sizes(per_node, {"CPU": float(os.cpu_count() or 1)}).get(Kind.TRAINING, 0)
    deadline = time.monotonic() + timeout_s
    while len(ready_to_train(process_tree(root))) < want:
        if time.monotonic() > deadline:
            raise SystemExit(f"the node's pool never held {want} processes ready to train")
        time.sleep(0.5)


def service_start(port: int, warm: str, spec: dict[str, Any]) -> tuple[float, float]:
    """One fresh service: the earlier job to its end, then the timed one; seconds from the
    timed job's POST to its first attempt's start (its supervisor up, the workers' places
    held), and to its first step."""
    with tempfile.TemporaryDirectory(prefix="etrain-first-step-") as data:
        base = f"http://127.0.0.1:{port}"
        server = serve(
            {
                "ETRAIN_DATA_DIR": data,
                "ETRAIN_PORT": str(port),
                "ETRAIN_WARM_PROCESSES_PER_NODE": warm,
            }
        )
        try:
            wait_ready(base, server)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with httpx.Client(base_url=base, headers=headers, timeout=60) as api:
                earlier = api.post("/v1/jobs", json={**spec, "name": "earlier"}).json()["id"]
                if wait_ended(api, earlier) != "succeeded":
                    raise SystemExit("the earlier job did not succeed")
                # Its processes gone, and the pools' new ones started and settled: a node
                # refills its pool once a CPU of it has been free for a while, and each new
                # process imports torch (seconds of both cores). A timed job that met a
                # process still importing would wait for it.
                pools_full(server.pid, int(warm))
                steady(server.pid)
                submitted = time.time()
                timed = api.post("/v1/jobs", json={**spec, "name": "timed"})
                timed.raise_for_status()
                first = first_step_at(api, timed.json()["id"]) - submitted
                if wait_ended(api, timed.json()["id"]) != "succeeded":
                    raise SystemExit("the timed job did not succeed")
                return attempt_started_at(api, timed.json()["id"]) - submitted, first
        finally:
            server.terminate()
            server.wait(60)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--port", type=int, default=8768)
    args = parser.parse_args()
    spec = yaml.safe_load(README_JOB.read_text())
    times: dict[str, list[float]] = {side: [] for side in [*SIDES, "torchrun"]}
    attempts: dict[str, list[float]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="etrain-first-step-torchrun-") as scratch:
        for r in range(args.repeat):
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for side in order:
                if side == "torchrun":
                    out = str(Path(scratch) / f"{r}.json")
                    seconds = run_torchrun("small_cnn", 2, out)["first_step_s"]
                else:
                    attempt, seconds = service_start(args.port, SIDES[side], spec)
                    attempts[side].append(attempt)
                times[side].append(seconds)
                print(f"round {r + 1}, {side}: {seconds:.2f} s", flush=True)
    torchrun = statistics.median(times["torchrun"])
    print()
    print(
        "| side | submit to attempt s | attempt to first step s | submit to first step s "
        "| / torchrun |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for side, values in times.items():
        split = ["", ""]
        if side in attempts:
            rest = [t - a for t, a in zip(values, attempts[side], strict=True)]
            split = [_cell(attempts[side]), _cell(rest)]
        ratio = statistics.median(values) / torchrun
        print(f"| {side} | {split[0]} | {split[1]} | {_cell(values)} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
