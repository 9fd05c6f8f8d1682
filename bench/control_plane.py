"""What do queued jobs cost the head node? Memory, processes and API latency against the
number of jobs waiting.

Starts the service (`etrain serve`, its own process, on its embedded local Ray with 2 CPUs
and SQLite), submits one job that takes both CPUs and trains until the end, then queues
jobs of the same shape behind it, level after level. At each level it counts the
service's processes (the service and every Ray process it started: they all descend from
it) and their memory (RSS), and times reads of the API one after the other: a job, a page
of 50 jobs, the scheduler's queue. Prints a table with the memory and processes each
queued job added, and draws them (--plot). Target: 1 000 queued jobs add at most 200 MB and
0 processes, with the API's p99 under 50 ms.

Then, with the queue empty, it runs --running jobs at once (each one worker with a tenth of a
CPU, running a command that sleeps: what a job costs the control plane, not its training),
and reports the memory each running job adds, proportional set size (PSS, so that pages
shared between processes count once), split into the job's supervisor (on the head node in
a cluster) and its worker (on a worker node in a cluster; here the one node is both), with
the API's latency while they run. Target: under 60 MB of the head per running job.

It also times first steps (--starts of each): of a job submitted to the idle cluster right
after another one ended (its supervisor starts at the submission), from its submission; and
of the first queued job once the job ahead of it is cancelled (its supervisor starts then),
from the cancel's answer. Loopback only.

    .venv/bin/python -m bench.control_plane [--levels 0,100,250,500,1000] [--reads 100]
        [--starts 3] [--running 20] [--plot docs/img/control_plane.png]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.api_load import TOKEN, percentile, serve, wait_ready
from elastic.warm_processes import IDLE_BEFORE_S, REPLACE_AFTER_S
from tests.processes import process_tree


def job(name: str, max_steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "max_steps": max_steps,
            "global_batch_size": 16,
            "learning_rate": 0.05,
            "seed": 0,
        },
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 1000, "keep": 1},
    }


def sleeper(name: str) -> dict[str, Any]:
    """A running job that costs the control plane only: one worker with a tenth of a CPU,
    whose command sleeps."""
    return {
        "name": name,
        "command": ["python", "-c", "import time; time.sleep(3600)"],
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.1},
    }


def rss_mb(pids: Iterable[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def pss_mb(pids: Iterable[int]) -> dict[str, float]:
    """Proportional set size (MB) of these processes by kind: the jobs' supervisors, and
    everything else."""
    out = {"supervisors": 0.0, "rest": 0.0}
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kb = sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
        out["supervisors" if title.startswith("ray::Supervisor") else "rest"] += kb / 1024
    return out


def running_jobs(
    api: httpx.Client, server: subprocess.Popen[bytes], count: int, reads: int
) -> dict[str, float]:
    """Memory and API latency with ``count`` jobs running at once, against the idle
    cluster; every job is cancelled after."""
    before = pss_mb(process_tree(server.pid))
    ids = []
    for i in range(count):
        answer = api.post("/v1/jobs", json=sleeper(f"running-{i}"))
        if answer.status_code not in (200, 201):
            raise SystemExit(f"the running job was refused: {answer.status_code} {answer.text}")
        ids.append(answer.json()["id"])
    deadline = time.monotonic() + 60 + 10 * count
    while True:
        states = [api.get(f"/v1/jobs/{j}").json()["state"] for j in ids]
        if all(state == "running" for state in states):
            break
        if time.monotonic() > deadline or any(x in ("failed", "cancelled") for x in states):
            events = api.get(f"/v1/jobs/{ids[0]}/events", params={"limit": 20}).json()["items"]
            raise SystemExit(
                f"the running jobs never all ran: {sorted(set(states))}; the first one's "
                f"events: {[(e['kind'], e['data']) for e in events]}"
            )
        time.sleep(1.0)
    steady(server.pid)  # their starts' leftovers (a GC, the pools' new processes) too
    pids = process_tree(server.pid)
    after = pss_mb(pids)
    timed = timed_reads(api, ids[0], reads)
    for job_id in ids:
        cancel(api, job_id)
    row = {
        "running": float(count),
        "processes": float(len(pids)),
        "supervisor_mb": (after["supervisors"] - before["supervisors"]) / count,
        "rest_mb": (after["rest"] - before["rest"]) / count,
    }
    for kind, ms in timed.items():
        row[f"{kind}_p50"] = statistics.median(ms)
        row[f"{kind}_p99"] = percentile(ms, 99)
    return row


def timed_reads(api: httpx.Client, job_id: str, reads: int) -> dict[str, list[float]]:
    paths = {
        "job": f"/v1/jobs/{job_id}",
        "page": "/v1/jobs?limit=50",
        "queue": "/v1/queue",
    }
    out: dict[str, list[float]] = {kind: [] for kind in paths}
    for _ in range(reads):
        for kind, path in paths.items():
            began = time.perf_counter()
            r = api.get(path)
            out[kind].append((time.perf_counter() - began) * 1000)
            r.raise_for_status()
    return out


def settle(api: httpx.Client, queued: int, timeout_s: float = 120.0) -> None:
    """Until the scheduler's queue holds every queued job."""
    deadline = time.monotonic() + timeout_s
    while api.get("/v1/queue").json()["waiting"] < queued:
        if time.monotonic() > deadline:
            raise SystemExit(f"the scheduler never showed {queued} queued jobs")
        time.sleep(0.5)
    time.sleep(2.0)  # what the rows left behind (a GC, a log line) is counted too


def steady(root: int, timeout_s: float = 120.0) -> None:
    """Until the processes under ``root`` stop coming and growing: the nodes' ready
    processes that replace those a job took start seconds after it did, once their node has
    had a CPU free for a while, then import torch (elastic/warm_processes.py)."""
    time.sleep(max(REPLACE_AFTER_S, IDLE_BEFORE_S) + 1.0)
    deadline = time.monotonic() + timeout_s
    last = process_tree(root)
    last_mb = rss_mb(last)
    while True:
        time.sleep(2.0)
        now = process_tree(root)
        now_mb = rss_mb(now)
        if len(now) == len(last) and abs(now_mb - last_mb) < 10.0:
            return
        if time.monotonic() > deadline:
            raise SystemExit("the service's processes never settled")
        last, last_mb = now, now_mb


def idle(api: httpx.Client, timeout_s: float = 120.0) -> None:
    """Until the scheduler holds no job, waiting or running."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = api.get("/v1/queue").json()
        if not view["waiting"] and not view["running"]:
            break
        if time.monotonic() > deadline:
            raise SystemExit("the cluster never emptied")
        time.sleep(0.5)
    time.sleep(2.0)  # the ended jobs' workers go back to Ray


def first_step_at(api: httpx.Client, job_id: str, timeout_s: float = 180.0) -> float:
    """When the job's first step ended (its step-1 metrics event), Unix seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = api.get(f"/v1/jobs/{job_id}/events", params={"kind": "metrics", "limit": 50})
        for e in page.json()["items"]:
            if e["data"].get("step") == 1:
                return datetime.fromisoformat(e["time"]).timestamp()
        time.sleep(0.05)
    raise SystemExit(f"{job_id} took no first step within {timeout_s:.0f} s")


def cancel(api: httpx.Client, job_id: str) -> None:
    api.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()


def plot(rows: list[dict[str, float]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    queued = [r["queued"] for r in rows]
    memory, procs, p99 = fig.subplots(1, 3)
    base = rows[0]["memory_mb"]
    memory.plot(queued, [r["memory_mb"] - base for r in rows], marker="o")
    memory.axhline(200, color="grey", linestyle="--", linewidth=1)
    memory.set(
        xlabel="queued jobs", ylabel="MB", title="Memory added (service + Ray)", ylim=(0, 250)
    )
    procs.plot(queued, [r["processes"] for r in rows], marker="o", color="tab:orange")
    procs.set(xlabel="queued jobs", ylabel="processes", title="Processes", ylim=(0, None))
    for kind in ("job", "page", "queue"):
        p99.plot(queued, [r[f"{kind}_p99"] for r in rows], marker="o", label=kind)
    p99.axhline(50, color="grey", linestyle="--", linewidth=1)
    p99.set(xlabel="queued jobs", ylabel="ms", title="API p99", ylim=(0, None))
    p99.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="0,100,250,500,1000", help="queued jobs")
    parser.add_argument("--reads", type=int, default=100, help="reads of each kind per level")
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--starts", type=int, default=3, help="timed starts of each kind")
    parser.add_argument("--running", type=int, default=20, help="jobs run at once (0: none)")
    args = parser.parse_args()
    levels = sorted(int(x) for x in args.levels.split(","))

    rows: list[dict[str, float]] = []
    running: dict[str, float] | None = None
    idle_starts: list[float] = []
    admitted_starts: list[float] = []
    with tempfile.TemporaryDirectory(prefix="etrain-control-plane-") as data:
        base = f"http://127.0.0.1:{args.port}"
        server = serve(
            {
                "ETRAIN_DATA_DIR": data,
                "ETRAIN_PORT": str(args.port),
                "ETRAIN_USER_MAX_ACTIVE_JOBS": str(max(levels) + args.running + 10),
                # The running jobs' workers take a tenth of a CPU each.
                "ETRAIN_MIN_CPUS_PER_WORKER": "0.1",
            }
        )
        try:
            wait_ready(base, server)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with httpx.Client(base_url=base, headers=headers, timeout=60) as api:
                # Submitted to the idle cluster, each after the one before: its supervisor
                # starts at the submission. The first warms the node up, untimed.
                for i in range(1 + args.starts):
                    submitted = time.time()
                    started = api.post("/v1/jobs", json=job(f"idle-{i}", 10_000_000)).json()
                    if i:
                        idle_starts.append(first_step_at(api, started["id"]) - submitted)
                    cancel(api, started["id"])
                blocker = api.post("/v1/jobs", json=job("blocker", 10_000_000)).json()["id"]
                deadline = time.monotonic() + 180
                while api.get(f"/v1/jobs/{blocker}").json()["state"] != "running":
                    if time.monotonic() > deadline:
                        raise SystemExit("the blocking job never ran")
                    time.sleep(0.5)
                timed_reads(api, blocker, 10)  # the first reads build caches: untimed
                steady(server.pid)
                queued = 0
                waiting: list[str] = []
                for level in levels:
                    while queued < level:
                        answer = api.post("/v1/jobs", json=job(f"queued-{queued}", 10_000_000))
                        answer.raise_for_status()
                        waiting.append(answer.json()["id"])
                        queued += 1
                    settle(api, queued)
                    pids = process_tree(server.pid)
                    reads = timed_reads(api, blocker, args.reads)
                    row = {"queued": float(level), "processes": float(len(pids))}
                    row["memory_mb"] = rss_mb(pids)
                    for kind, ms in reads.items():
                        row[f"{kind}_p50"] = statistics.median(ms)
                        row[f"{kind}_p99"] = percentile(ms, 99)
                    rows.append(row)
                    print(f"{level} queued: {len(pids)} processes, {row['memory_mb']:.0f} MB")
                # The job ahead ends; the first in line is told to start and gets its
                # supervisor then. Timed from the cancel's answer to its first step.
                ahead = blocker
                for _ in range(args.starts):
                    line = api.get("/v1/queue").json()["queue"][0]["job_id"]
                    cancel(api, ahead)
                    ended = time.time()
                    admitted_starts.append(first_step_at(api, line) - ended)
                    ahead = line
                cancel(api, ahead)
                if args.running:
                    # The cluster emptied: what still waits is cancelled first.
                    for job_id in waiting:
                        api.post(f"/v1/jobs/{job_id}/cancel")  # 409 for one that ended
                    idle(api)
                    running = running_jobs(api, server, args.running, args.reads)
        finally:
            server.terminate()
            server.wait(60)

    first = rows[0]
    print()
    print(
        f"{'queued':>7} {'processes':>9} {'memory MB':>9} {'+MB/job':>7} "
        f"{'job p50/p99 ms':>15} {'page p50/p99 ms':>16} {'queue p50/p99 ms':>17}"
    )
    for r in rows:
        per_job = (
            (r["memory_mb"] - first["memory_mb"]) / (r["queued"] - first["queued"])
            if r["queued"] > first["queued"]
            else 0.0
        )
        cells = [f"{r[f'{k}_p50']:.1f}/{r[f'{k}_p99']:.1f}" for k in ("job", "page", "queue")]
        print(
            f"{r['queued']:>7.0f} {r['processes']:>9.0f} {r['memory_mb']:>9.0f} {per_job:>7.2f} "
            f"{cells[0]:>15} {cells[1]:>16} {cells[2]:>17}"
        )
    last = rows[-1]
    print(
        f"\n{last['queued'] - first['queued']:.0f} queued jobs added "
        f"{last['memory_mb'] - first['memory_mb']:.0f} MB and "
        f"{last['processes'] - first['processes']:.0f} processes "
        f"(target: at most 200 MB and 0 per 1 000)"
    )
    print(
        "first step, median (range) of "
        f"{args.starts}: submitted to the idle cluster {_spread(idle_starts)} s after the "
        f"submission; queued, {_spread(admitted_starts)} s after the job ahead was cancelled"
    )
    if running is not None:
        cells = [
            f"{running[f'{k}_p50']:.1f}/{running[f'{k}_p99']:.1f}" for k in ("job", "page", "queue")
        ]
        print(
            f"\n{running['running']:.0f} jobs running at once: per job, "
            f"{running['supervisor_mb']:.0f} MB of supervisor (the head's share in a cluster) "
            f"and {running['rest_mb']:.0f} MB of the rest (its worker and command); "
            f"{running['processes']:.0f} processes; job/page/queue p50/p99 ms {' '.join(cells)} "
            "(target: under 60 MB of the head per running job)"
        )
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
