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
to torchrun. Target: the pool's median within 1 s, under a third of torchrun's launch.

    .venv/bin/python -m bench.first_step [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.api_load import TOKEN, serve, wait_ready
from bench.control_plane import first_step_at, steady
from bench.throughput import run_torchrun

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


def service_start(port: int, warm: str, spec: dict[str, Any]) -> float:
    """One fresh service: the earlier job to its end, then the timed one; seconds from the
    timed job's POST to its first step."""
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
                # process imports torch (seconds of both cores).
                steady(server.pid)
                submitted = time.time()
                timed = api.post("/v1/jobs", json={**spec, "name": "timed"})
                timed.raise_for_status()
                first = first_step_at(api, timed.json()["id"]) - submitted
                if wait_ended(api, timed.json()["id"]) != "succeeded":
                    raise SystemExit("the timed job did not succeed")
                return first
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
    with tempfile.TemporaryDirectory(prefix="etrain-first-step-torchrun-") as scratch:
        for r in range(args.repeat):
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for side in order:
                if side == "torchrun":
                    out = str(Path(scratch) / f"{r}.json")
                    seconds = run_torchrun("small_cnn", 2, out)["first_step_s"]
                else:
                    seconds = service_start(args.port, SIDES[side], spec)
                times[side].append(seconds)
                print(f"round {r + 1}, {side}: {seconds:.2f} s", flush=True)
    torchrun = statistics.median(times["torchrun"])
    print()
    print("| side | submit to first step s | / torchrun |")
    print("| --- | ---: | ---: |")
    for side, values in times.items():
        print(f"| {side} | {_cell(values)} | {statistics.median(values) / torchrun:.2f} |")


if __name__ == "__main__":
    main()
