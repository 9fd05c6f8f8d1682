"""Recovery after a host is lost, on Ray nodes that are hosts: elastic-train in both modes.

The cluster is the test bed of ``tests/hosts.py``: a head on a bridge and three one-CPU
worker nodes, each in network, UTS and mount namespaces of its own (its own address, a host
name the others cannot resolve), the service as a separate ``etrain serve`` connected to the
head. That is what a user's cluster is, unlike ``bench/recovery.py``'s nodes, which share
loopback. The job is ``bench/recovery.py``'s (the small CNN, global batch 60, a checkpoint
every 10 steps). Once step KILL_AT_STEP is seen at 3 workers, every process of the host
that holds rank 1 is SIGKILLed (a machine lost); once the smaller world reaches
GROW_AT_STEP, a host is added back. The modes alternate, each first in turn, --repeat times.
The figures come from the same step records and summary as ``bench/recovery.py``'s.

With ``--failure two-hosts``, a second host is killed 0.3 s after the first (one rack, one
spot pool), and the figures run to the first step without both; one host is added back.

With ``--failure supervisor``, the job's supervisor's process is SIGKILLed at that step
instead (on the head's host, where supervisors run) and no host is lost: the service
re-creates the supervisor. In place the replicas train on and the new one adopts them; in
restart mode a new worker group starts from the latest checkpoint.

Needs root (network namespaces), ``ip`` and ``unshare``.

    .venv/bin/python -m bench.recovery_hosts --repeat 3
    .venv/bin/python -m bench.recovery_hosts --repeat 3 --failure supervisor
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.recovery import (
    JobEvents,
    job_spec,
    metrics_records,
    print_table,
    stamp,
    with_samples,
)
from bench.recovery_ray import BATCH, GROW_AT_STEP, KILL_AT_STEP, STEPS, WORKER_NODES
from bench.recovery_records import StepRecord, summarize
from tests.conftest import wait_for
from tests.hosts import HostCluster, bench_cluster, service

MODES = ["restart", "in_place"]
HEADERS = {"restart": "ours, restart", "in_place": "ours, in_place"}
ENDED = ("succeeded", "failed", "cancelled")
FAILURES = ("host", "two-hosts", "supervisor")
# How long after the first host the second goes, with --failure two-hosts.
APART_S = 0.3


def supervisor_pid() -> int:
    """The one job's supervisor process on this machine (Ray titles a worker after its
    actor's class)."""

    def pids() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::Supervisor"):
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
        return found

    (pid,) = wait_for(lambda: p if len(p := pids()) == 1 else None, 30, what="one supervisor")
    return int(pid)


def rank1_host(api: httpx.Client, hosts: HostCluster, job_id: str) -> Any:
    """The host whose node holds the job's rank 1 (replica 1 in place), once it is known."""
    (job,) = [j for j in api.get("/v1/cluster").json()["jobs"] if j["id"] == job_id]
    node = job["workers"].get("1")
    return next((h for h in hosts.hosts if h.node_id == node and h.alive), None)


def with_unreported_steps(records: list[StepRecord], job_root: Path) -> list[StepRecord]:
    """The steps the sample audit holds and no report does. In place, the quorum's rank 0
    reports each step, and one lost right after a commit takes that report with it (the
    survivors hold the step, and every committing replica audits the whole batch). In
    restart mode, a supervisor lost takes the reports in flight to it with it, while the
    checkpoint the next attempt starts from holds their steps (each rank audits its share).
    Each is counted at the time of a step its attempt reported: it adds no pause."""
    reported = {(r.attempt, r.step) for r in records}
    last_report: dict[str, StepRecord] = {}
    for r in records:
        if r.attempt not in last_report or r.time > last_report[r.attempt].time:
            last_report[r.attempt] = r
    audited: dict[tuple[str, int], list[int]] = {}
    for f in sorted((job_root / "samples").iterdir()):
        whole = "replica" in f.name
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = (str(r["a"]), r["s"])
            if whole:
                audited.setdefault(key, r["i"])
            else:
                audited.setdefault(key, []).extend(r["i"])
    added = []
    for (attempt, step), indices in audited.items():
        if (attempt, step) in reported:
            continue
        # The attempt's next reported step; after its last one (the reports died with a
        # supervisor), its last reported step: a later attempt that redid the step then
        # holds it in the final model, as it should.
        later = min(
            (r for r in records if r.attempt == attempt and r.step > step),
            key=lambda r: r.step,
            default=None,
        ) or last_report.get(attempt)
        if later is not None:
            added.append(replace(later, step=step, indices=tuple(indices)))
    return sorted([*records, *added], key=lambda r: (r.time, r.step))


def run(
    api: httpx.Client, hosts: HostCluster, root: Path, mode: str, failure: str
) -> dict[str, float]:
    hosts.restore(WORKER_NODES)
    started = time.time()
    job_id = api.post("/v1/jobs", json=job_spec(STEPS, mode)).json()["id"]
    events = JobEvents(api, job_id)
    while True:
        seen = metrics_records(events())
        if any(r.step >= KILL_AT_STEP and r.world == WORKER_NODES for r in seen):
            if failure == "supervisor":
                break
            victim = rank1_host(api, hosts, job_id)
            if victim is not None:
                break
        time.sleep(0.02)
    if failure == "supervisor":
        pid = supervisor_pid()
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        return supervisor_figures(api, events, root / job_id, started, killed_at)
    killed_at = victim.kill()
    lost = 1
    if failure == "two-hosts":
        second = next(h for h in hosts.alive() if h is not victim)
        time.sleep(max(0.0, killed_at + APART_S - time.time()))
        second.kill()
        lost = 2
    added_at = None
    while api.get(f"/v1/jobs/{job_id}").json()["state"] not in ENDED:
        seen = metrics_records(events())
        if added_at is None and any(
            r.time > killed_at and r.world < WORKER_NODES and r.step >= GROW_AT_STEP for r in seen
        ):
            hosts.add_node()
            added_at = time.time()
        time.sleep(0.2)
    final = api.get(f"/v1/jobs/{job_id}").json()
    assert final["state"] == "succeeded", final
    items = events()
    records = with_samples(metrics_records(items), root / job_id)
    if mode == "in_place":
        records = with_unreported_steps(records, root / job_id)
    figures = summarize(records, started, killed_at, added_at, STEPS, BATCH, lost=lost)
    if mode == "in_place":
        # The last loss event of the failure: it spans the quorum changes before it.
        losses = [e["data"] for e in items if e["kind"] == "worker_lost"]
        figures |= {
            "reported_s": losses[-1]["recovery_seconds"],
            "reported_pause_s": losses[-1]["pause_seconds"],
            "reported_redone": sum(x["steps_redone"] for x in losses),
            # A step thrown away leaves no record (only committed steps are reported).
            "steps_redone": sum(x["steps_redone"] for x in losses),
        }
    else:
        shrink = next(e["data"] for e in items if e["kind"] == "resized")
        figures["reported_s"] = shrink["recovery_seconds"]
    return figures | {"grew": float("grow_s" in figures)}


def supervisor_figures(
    api: httpx.Client,
    events: JobEvents,
    job_root: Path,
    started: float,
    killed_at: float,
) -> dict[str, float]:
    """The job ends; its figures, the span after the kill ending at the first step after
    the re-created supervisor's ``supervisor_recreated`` event."""
    while api.get(f"/v1/jobs/{job_root.name}").json()["state"] not in ENDED:
        time.sleep(0.2)
    final = api.get(f"/v1/jobs/{job_root.name}").json()
    assert final["state"] == "succeeded", final
    items = events()
    (note,) = [e for e in items if e["kind"] == "supervisor_recreated"]
    records = with_unreported_steps(with_samples(metrics_records(items), job_root), job_root)
    attempts = sum(e["kind"] == "attempt_started" for e in items)
    figures = summarize(records, started, killed_at, None, STEPS, BATCH, stamp(note))
    return figures | {"attempts": float(attempts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each mode (>= 3)")
    parser.add_argument("--failure", choices=FAILURES, default="host", help="what is killed")
    args = parser.parse_args()
    work, hosts = bench_cluster(parser, "etrain-bench-hosts-")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        hosts.start(WORKER_NODES)
        with service(hosts, work / "service") as api:
            for rep in range(args.repeat):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    figures = run(api, hosts, work / "service" / "checkpoints", mode, args.failure)
                    results[mode].append(figures)
                    print(f"repetition {rep + 1}, {mode}: {figures}", flush=True)
    finally:
        hosts.close()
    print()
    lost = {
        "host": "a host",
        "two-hosts": f"two hosts, {APART_S} s apart,",
        "supervisor": "the job's supervisor",
    }[args.failure]
    print(f"median (range) of {args.repeat} runs per mode, on 3 nodes that are hosts;")
    print(f"{lost} killed at step {KILL_AT_STEP}")
    print()
    print_table({HEADERS[mode]: results[mode] for mode in MODES})


if __name__ == "__main__":
    main()
