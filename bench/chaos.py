"""A chaos soak on Ray nodes that are hosts: one job through a random sequence of failures.

The cluster is ``tests/hosts.py``'s: a head and three one-CPU worker nodes, each a host of
its own (own address, own host name), the service a separate ``etrain serve``. The job is
the float64 job of the hosts tests (the small CNN, a batch of 63 over 1 000 samples,
augmentations on, every sample recorded), sized to last about --minutes when nothing fails.

Three runs of the same job, one after the other:

1. **clean**: no failure; the reference model, wall time and throughput.
2. **lossy**: one host drops 2 % of its packets each way for the whole run. Every
   ``worker_lost`` or ``resized`` is a false recovery; the throughput is printed beside the
   clean run's.
3. **soak**: every --every seconds (first after as long from the first step) one failure,
   drawn with --seed from: a host killed (every process, SIGKILL), cut off (both ways, or
   one way: it hears its peers and they do not hear it) or frozen (SIGSTOP) for 10 s, or
   its packets dropped at 2 % for 30 s. A host killed, cut or frozen is replaced by a
   fresh one (capacity comes back), as a cluster's autoscaler would; Ray has declared a
   cut or frozen node dead by the time it is mended, so it is killed then.

Printed: each failure's pause (from the injection to the next step; the longest gap
between steps within 3 s of it) and the job's own losses in its window; the goodput (the
clean run's wall time over the soak's, submit to end, for the same steps); and whether each
run's final float64 model equals the clean run's, with every sample trained once per
epoch. Goal: goodput >= 0.9 at one failure a minute.

Not drawn here: the supervisor's loss (``bench/recovery_hosts.py --failure supervisor``
measures it on this bed) and the head's GCS (this bed keeps no GCS state in Redis; the hosts
tests kill and restart it under a job, tests/integration/test_hosts.py).

Needs root (network namespaces), ``ip``, ``unshare`` and ``nft``.

    .venv/bin/python -m bench.chaos --minutes 10 --every 60
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.recovery import stamp
from elastic.job_state import TERMINAL_STATES
from tests.conftest import (
    all_events,
    longest_pause_after,
    wait_for,
    wait_until_ended,
)
from tests.hosts import Host, HostCluster, bench_cluster, service
from tests.integration.test_elastic import BATCH, final_state
from tests.integration.test_hosts import assert_samples_once, exact_job

NODES = 3
LOSSY_PERCENT = 2
CUT_S = 10.0  # how long a host stays cut off or frozen
DEGRADE_S = 30.0  # how long a host drops packets, in the soak
FAULTS = ("kill", "partition", "one-way partition", "freeze", "degrade")
PROBE_STEPS = 40


@dataclass
class Run:
    """One job's run: its events and wall time, submit to end."""

    job_id: str
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == "metrics"]

    def losses(self, start: float = 0.0, end: float = float("inf")) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["kind"] in ("worker_lost", "resized") and start <= stamp(e) < end
        ]

    def samples_per_s(self) -> float:
        """Steady throughput: samples over the time from the first step to the last."""
        times = [stamp(e) for e in self.metrics()]
        steps = max(e["data"]["step"] for e in self.metrics())
        return (steps - 1) * BATCH / (max(times) - min(times))


@dataclass
class Fault:
    kind: str
    host: int
    at: float


def submit(api: httpx.Client, steps: int, mode: str) -> tuple[str, float]:
    started = time.time()
    return api.post("/v1/jobs", json=exact_job(steps, fault_tolerance=mode)).json()["id"], started


def finish(api: httpx.Client, job_id: str, started: float, timeout_s: float) -> Run:
    done = wait_until_ended(api, job_id, timeout_s)
    ended = time.time()
    if done["state"] != "succeeded":
        raise SystemExit(f"job {job_id} ended {done['state']}: {done}")
    print(f"  {job_id}: {done['step']} steps in {ended - started:.1f} s", flush=True)
    return Run(job_id, ended - started, all_events(api, job_id))


def first_step_at(api: httpx.Client, job_id: str) -> float:
    while api.get(f"/v1/jobs/{job_id}").json()["step"] < 1:
        time.sleep(0.2)
    return time.time()


def ended(api: httpx.Client, job_id: str) -> bool:
    return api.get(f"/v1/jobs/{job_id}").json()["state"] in TERMINAL_STATES


def inject(host: Host, kind: str) -> Fault:
    if kind == "kill":
        return Fault(kind, host.index, host.kill())
    if kind == "freeze":
        return Fault(kind, host.index, host.freeze())
    if kind == "degrade":
        return Fault(kind, host.index, host.degrade(LOSSY_PERCENT))
    return Fault(kind, host.index, host.partition(one_way=kind == "one-way partition"))


def mend(hosts: HostCluster, host: Host, fault: Fault) -> None:
    """A degraded host heals; a host killed, cut or frozen is gone for Ray: a fresh one
    takes its place."""
    if fault.kind == "degrade":
        time.sleep(max(0.0, fault.at + DEGRADE_S - time.time()))
        host.heal()
    elif fault.kind != "kill":
        time.sleep(max(0.0, fault.at + CUT_S - time.time()))
        if fault.kind == "freeze":
            host.thaw()
        else:
            host.heal()
        host.kill()
    if fault.kind != "degrade":
        wait_for(lambda: not host.alive, timeout=30, what=f"host {host.index}'s end")
        if host.proc is not None:
            host.proc.wait(timeout=30)
        hosts.restore(NODES)


def soak(
    api: httpx.Client, hosts: HostCluster, steps: int, mode: str, every_s: float, seed: int
) -> tuple[Run, list[Fault]]:
    rng = random.Random(seed)
    job_id, started = submit(api, steps, mode)
    faults: list[Fault] = []
    next_at = first_step_at(api, job_id) + every_s
    while True:
        while time.time() < next_at and not ended(api, job_id):
            time.sleep(0.2)
        if ended(api, job_id):
            break
        kind = rng.choice(FAULTS)
        host = rng.choice(hosts.alive())
        fault = inject(host, kind)
        print(f"  {fault.at - started:6.1f} s: {kind} of host {host.index}", flush=True)
        faults.append(fault)
        mend(hosts, host, fault)
        next_at += every_s
    return finish(api, job_id, started, 60), faults


def every_sample_once(run: Run, root: Path, steps: int, mode: str) -> str:
    """'yes' when every sample of every epoch went into the model once, else what differs."""
    try:
        assert_samples_once(root / run.job_id, steps, mode)
    except AssertionError as e:
        return f"no ({e})"
    return "yes"


def largest_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of any parameter or momentum entry."""
    worst = 0.0
    for name, tensor in reference.items():
        scale = tensor.abs().max().item() or 1.0
        worst = max(worst, (ours[name] - tensor).abs().max().item() / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10, help="a clean run's length")
    parser.add_argument("--every", type=float, default=60, help="seconds between failures")
    parser.add_argument("--mode", choices=["in_place", "restart"], default="in_place")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    work, hosts = bench_cluster(parser, "etrain-bench-chaos-")
    root = work / "service" / "checkpoints"
    try:
        hosts.start(NODES)
        with service(hosts, work / "service") as api:
            probe = finish(api, *submit(api, PROBE_STEPS, args.mode), 600)
            rate = probe.samples_per_s() / BATCH
            steps = max(PROBE_STEPS, round(args.minutes * 60 * rate / 16) * 16)
            print(f"{steps} steps ({rate:.2f} steps/s in a probe of {PROBE_STEPS})", flush=True)
            timeout = 10 * args.minutes * 60 + 600
            print("clean run", flush=True)
            clean = finish(api, *submit(api, steps, args.mode), timeout)
            reference = final_state(api, clean.job_id, root)
            print(f"lossy run: host 1 drops {LOSSY_PERCENT} % of its packets", flush=True)
            hosts.restore(NODES)
            lossy_host = hosts.alive()[0]
            lossy_host.degrade(LOSSY_PERCENT)
            try:
                lossy = finish(api, *submit(api, steps, args.mode), timeout)
            finally:
                lossy_host.heal()
            print(f"soak: a failure every {args.every:.0f} s", flush=True)
            hosts.restore(NODES)
            chaos, faults = soak(api, hosts, steps, args.mode, args.every, args.seed)
            results = {
                "lossy": largest_difference(final_state(api, lossy.job_id, root), reference),
                "soak": largest_difference(final_state(api, chaos.job_id, root), reference),
            }
    finally:
        hosts.close()
    report(args, steps, clean, lossy, chaos, faults, results, root)


def report(
    args: argparse.Namespace,
    steps: int,
    clean: Run,
    lossy: Run,
    chaos: Run,
    faults: list[Fault],
    differences: dict[str, float],
    root: Path,
) -> None:
    print()
    print(f"{args.mode}, {steps} steps on {NODES} nodes that are hosts, seed {args.seed}")
    print()
    print("| failure | host | at (s) | pause (s) | losses the job saw |")
    print("|---|---|---|---|---|")
    metrics = chaos.metrics()
    first = min(stamp(e) for e in metrics)
    pauses = []
    for i, fault in enumerate(faults):
        until = faults[i + 1].at if i + 1 < len(faults) else float("inf")
        seen = len([e for e in chaos.losses(fault.at, until) if e["kind"] == "worker_lost"])
        if max(stamp(e) for e in metrics) <= fault.at:  # drawn as the job took its last step
            print(f"| {fault.kind} | {fault.host} | {fault.at - first:.0f} | after the end | - |")
            continue
        pause = longest_pause_after(fault.at, metrics, 3.0)
        if fault.kind != "degrade":
            pauses.append(pause)
        print(f"| {fault.kind} | {fault.host} | {fault.at - first:.0f} | {pause:.2f} | {seen} |")
    print()
    if pauses:
        print(
            f"pause per loss: median {statistics.median(pauses):.2f} s, "
            f"range {min(pauses):.2f}-{max(pauses):.2f} s"
        )
    print()
    print("| run | wall (s) | samples/s | false recoveries | goodput | samples once, model diff |")
    print("|---|---|---|---|---|---|")
    for name, run in (("clean", clean), ("lossy", lossy), ("soak", chaos)):
        goodput = clean.wall_s / run.wall_s
        same = every_sample_once(run, root, steps, args.mode)
        same += f", {differences.get(name, 0.0):.1e}"
        cells = [
            name,
            f"{run.wall_s:.0f}",
            f"{run.samples_per_s():.1f}",
            str(len(run.losses())) if name == "lossy" else "-",
            f"{goodput:.2f}",
            same,
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
