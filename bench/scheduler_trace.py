"""Does the scheduling policy shorten jobs' completion times? A discrete-event simulation of a
generated trace on simulated clusters of 64 and 1024 workers (nodes of 8 one-GPU slots),
run under three schedulers on the same trace:

  (a) fcfs        first come first served, whole jobs (what Ray and Kueue give): a job
                  runs at its max_workers clamped to the cluster, gang-started when that
                  many are free, strictly in arrival order (Kueue's StrictFIFO), never
                  resized or preempted. Priorities are ignored.
  (a') fcfs-bf    the same with backfill (Kueue's BestEffortFIFO): a later job that fits
                  starts when the head does not. Shown for context.
  (b) policy-rigid  elastic/cluster/scheduling.py's plan() with Knobs(resize_running=False):
                  priorities, preemption, sizes chosen at start, never resized after.
  (c) policy      plan() as the service runs it: called on every arrival, completion and
                  a periodic tick; every resize costs its pause.

The trace (seeded): Poisson arrivals; max_workers a power of two up to a quarter of the
cluster, min_workers its half, quarter or eighth (a quarter of the jobs rigid, min = max);
priorities low/normal/high (20/60/20 %); throughput from Amdahl's law, samples/s at n workers
= r * n / (1 + s * (n - 1)), serial fraction s in {0, 0.01, 0.05, 0.15, 0.3}; each job a
fixed amount of work, samples = its throughput at max_workers times a duration drawn
log-uniform in [10 min, 3 h]. The arrival rate is set so the offered load (work at max size,
in worker-seconds) is LOAD of the cluster; the same for both cluster sizes so utilisation is
comparable. Costs: a start or a restart-type resize pauses the job 5 s, an in-place resize
1 s (half of the jobs each); a preemption also loses the work since the job's last checkpoint
(every 10 min of running). The policy is fed each size's measured throughput (the curve with
2 % noise) as the service would.

    .venv/bin/python -m bench.scheduler_trace [--seeds 3] [--jobs 150] [--quick]

Prints, per cluster size and scheduler, the median over seeds (and range) of the average and
median job completion time (JCT, arrival to done), the makespan and the utilisation
(workers held / workers x makespan), then (c)'s average JCT over (a)'s and over (b)'s.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from elastic.cluster.scheduling import Change, Demand, JobRecord, Knobs, plan

NODE_SLOTS = 8
START_S = 5.0  # a start, or a restart-type resize (checkpoint, restart on warm workers)
IN_PLACE_S = 1.0
CHECKPOINT_EVERY_S = 600.0
TICK_S = 300.0  # the policy's periodic re-plan (measurements change, dwell expires)
NOISE = 0.02
LOAD = 0.85
PRIORITIES = [(0, 0.2), (50, 0.6), (100, 0.2)]
SERIAL = [0.0, 0.01, 0.05, 0.15, 0.3]


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    arrival: float
    priority: int
    min_workers: int
    max_workers: int
    rate1: float  # samples/s on one worker
    serial: float  # Amdahl's serial fraction
    work: float  # samples to process
    resize: str  # "in_place" or "restart"

    def speed(self, n: int) -> float:
        return self.rate1 * n / (1 + self.serial * (n - 1)) if n > 0 else 0.0


def make_trace(seed: int, cluster: int, jobs: int, load: float = LOAD) -> list[TraceJob]:
    rng = random.Random(seed)
    drafts = []
    top = max(0, int(math.log2(max(1, cluster // 4))))
    for i in range(jobs):
        hi = 2 ** rng.randint(0, top)
        lo = max(1, hi // rng.choice([1, 2, 4, 8]))
        prio = rng.choices([p for p, _ in PRIORITIES], [w for _, w in PRIORITIES])[0]
        duration = math.exp(rng.uniform(math.log(600.0), math.log(3 * 3600.0)))
        drafts.append((f"j{i}", prio, lo, hi, rng.uniform(50, 200), rng.choice(SERIAL), duration))
    mean_demand = statistics.fmean(d[3] * d[6] for d in drafts)  # worker-seconds at max
    rate = load * cluster / mean_demand  # arrivals per second
    t = 0.0
    out = []
    for jid, prio, lo, hi, r1, s, duration in drafts:
        t += rng.expovariate(rate)
        job = TraceJob(jid, t, prio, lo, hi, r1, s, 0.0, rng.choice(["in_place", "restart"]))
        out.append(replace(job, work=job.speed(hi) * duration))
    return out


@dataclass
class Run:
    """One job's state in the simulation."""

    job: TraceJob
    record: JobRecord
    size: int = 0
    paused_until: float = 0.0
    left: float = 0.0  # samples still to process
    since_ckpt_s: float = 0.0  # running seconds since the last checkpoint
    since_ckpt_work: float = 0.0
    processed: float = 0.0  # all samples processed, lost ones included
    lost: float = 0.0
    done_at: float | None = None
    started_at: float | None = None
    preemptions: int = 0
    resizes: int = 0
    held_s: float = 0.0  # worker-seconds held


@dataclass
class Result:
    scheduler: str
    cluster: int
    jct: list[float]
    makespan: float
    utilisation: float
    runs: list[Run] = field(default_factory=list)
    plans: int = 0


Scheduler = Callable[[float, list[Run], int], dict[str, int]]


def fcfs(backfill: bool) -> Scheduler:
    """Gang scheduling at a fixed size in arrival order; running jobs keep their size."""

    def decide(now: float, runs: list[Run], cluster: int) -> dict[str, int]:
        free = cluster - sum(r.size for r in runs)
        sizes = {}
        for r in sorted((r for r in runs if r.size == 0), key=lambda r: r.job.arrival):
            want = min(r.job.max_workers, cluster)
            if want <= free:
                sizes[r.job.job_id] = want
                free -= want
            elif not backfill:
                break
        return sizes

    return decide


def policy(knobs: Knobs, nodes: Sequence[dict[str, float]]) -> Scheduler:
    def decide(now: float, runs: list[Run], cluster: int) -> dict[str, int]:
        out = plan(nodes, [r.record for r in runs], {}, now, knobs)
        for r in runs:
            r.record.borrowed = out[r.job.job_id].borrowed
        return {j: p.size for j, p in out.items() if p.change is not Change.KEEP}

    return decide


def simulate(trace: Sequence[TraceJob], cluster: int, name: str, seed: int = 0) -> Result:
    """Run ``trace`` on ``cluster`` workers under the scheduler called ``name``."""
    nodes = [{"GPU": float(NODE_SLOTS)} for _ in range(cluster // NODE_SLOTS)]
    decide = {
        "fcfs": fcfs(backfill=False),
        "fcfs-bf": fcfs(backfill=True),
        "policy-rigid": policy(Knobs(resize_running=False), nodes),
        "policy": policy(Knobs(), nodes),
    }[name]
    periodic = name.startswith("policy")
    noise = random.Random(seed * 7919 + cluster)
    pending = sorted(trace, key=lambda j: j.arrival)
    active: list[Run] = []
    finished: list[Run] = []
    now, next_arrival, next_tick, plans = 0.0, 0, TICK_S, 0

    def apply(sizes: dict[str, int]) -> None:
        for r in active:
            new = sizes.get(r.job.job_id, r.size)
            if new == r.size:
                continue
            if r.started_at is None:
                r.started_at = now
            elif new == 0:
                r.preemptions += 1
            elif r.size:
                r.resizes += 1
            if new == 0:  # preempted: back to the last checkpoint
                r.left += r.since_ckpt_work
                r.lost += r.since_ckpt_work
                r.since_ckpt_s = r.since_ckpt_work = 0.0
            elif r.size == 0 or r.job.resize == "restart":
                r.paused_until = now + START_S
                r.since_ckpt_s = r.since_ckpt_work = 0.0  # restarts from a fresh checkpoint
            else:
                r.paused_until = now + IN_PLACE_S
            r.size = new
            r.record.size, r.record.changed_at = new, now

    while next_arrival < len(pending) or active:
        # The next event: an arrival, a completion, a pause ending (a measurement), a tick.
        times = [pending[next_arrival].arrival] if next_arrival < len(pending) else []
        for r in active:
            if r.size and r.paused_until > now:
                times.append(r.paused_until)
            elif r.size:
                times.append(now + r.left / r.job.speed(r.size))
        if periodic and active:
            times.append(next_tick)
        t = min(times)
        _advance(active, now, t)
        now = t
        changed = False
        while next_arrival < len(pending) and pending[next_arrival].arrival <= now:
            active.append(_arrive(pending[next_arrival]))
            next_arrival += 1
            changed = True
        for r in [r for r in active if r.size and r.left <= 1e-6 * r.job.work]:
            r.done_at, r.size = now, 0
            active.remove(r)
            finished.append(r)
            changed = True
        for r in active:  # the service's throughput measurement, once the pause is over
            if r.size and r.paused_until <= now and r.size not in r.record.throughput:
                r.record.throughput[r.size] = r.job.speed(r.size) * noise.gauss(1.0, NOISE)
        if periodic and now >= next_tick:
            next_tick = now + TICK_S
            changed = True
        if changed and active:
            apply(decide(now, active, cluster))
            plans += 1
    makespan = max(r.done_at or 0.0 for r in finished) - min(j.arrival for j in trace)
    held = sum(r.held_s for r in finished)
    jct = [(r.done_at or 0.0) - r.job.arrival for r in finished]
    return Result(name, cluster, jct, makespan, held / (cluster * makespan), finished, plans)


def _arrive(job: TraceJob) -> Run:
    demand = Demand(
        job.job_id,
        owner="team",
        priority=job.priority,
        min_workers=job.min_workers,
        max_workers=job.max_workers,
        per_worker={"GPU": 1.0},
        submitted_at=job.arrival,
        resize=job.resize,
    )
    return Run(job, JobRecord(demand), left=job.work)


def _advance(active: list[Run], start: float, end: float) -> None:
    """Progress every running job from ``start`` to ``end`` (rates are constant between)."""
    for r in active:
        if not r.size:
            continue
        r.held_s += r.size * (end - start)
        run_from = max(start, r.paused_until)
        if end <= run_from:
            continue
        dt = end - run_from
        rate = r.job.speed(r.size)
        done = min(r.left, rate * dt)
        r.left -= done
        r.processed += done
        r.since_ckpt_s += dt
        r.since_ckpt_work += done
        if r.since_ckpt_s >= CHECKPOINT_EVERY_S:  # a checkpoint was taken in this interval
            r.since_ckpt_s %= CHECKPOINT_EVERY_S
            r.since_ckpt_work = min(r.since_ckpt_work, rate * r.since_ckpt_s)


# -- the report --------------------------------------------------------------------------------

SCHEDULERS = ["fcfs", "fcfs-bf", "policy-rigid", "policy"]


def _spread(values: Sequence[float], unit: float = 1.0, fmt: str = "{:.0f}") -> str:
    v = [x / unit for x in values]
    return f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"


def _wait(r: Result) -> float:
    return statistics.fmean((x.started_at or 0.0) - x.job.arrival for x in r.runs)


def _ideal(r: Result) -> list[float]:
    return [x.job.work / x.job.speed(x.job.max_workers) for x in r.runs]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=150)
    ap.add_argument("--clusters", default="64,1024")
    ap.add_argument("--load", type=float, default=LOAD, help="offered load (work at max size)")
    ap.add_argument("--quick", action="store_true", help="a tiny trace: 30 jobs, 2 seeds")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.jobs = 2, 30
    clusters = [int(c) for c in args.clusters.split(",")]
    began = time.monotonic()
    print(
        f"trace: {args.jobs} jobs/seed, seeds 0-{args.seeds - 1}, offered load "
        f"{args.load:.2f} of the cluster (work at max size; the same for every cluster size, "
        f"so utilisation compares), "
        f"nodes of {NODE_SLOTS} workers, pauses {START_S:g} s start/restart, "
        f"{IN_PLACE_S:g} s in place, checkpoints every {CHECKPOINT_EVERY_S:g} s, "
        f"re-plan tick {TICK_S:g} s. Median over seeds (min-max)."
    )
    head = (
        f"{'workers':>7}  {'scheduler':<13} {'avg JCT h':<18} {'median JCT h':<18} "
        f"{'avg wait h':<18} {'makespan h':<18} {'utilisation':<18} {'plans':>6}"
    )
    print(head)
    for cluster in clusters:
        results: dict[str, list[Result]] = {s: [] for s in SCHEDULERS}
        for seed in range(args.seeds):
            trace = make_trace(seed, cluster, args.jobs, args.load)
            for s in SCHEDULERS:
                results[s].append(simulate(trace, cluster, s, seed))
        for s in SCHEDULERS:
            rs = results[s]
            print(
                f"{cluster:>7}  {s:<13} "
                f"{_spread([statistics.fmean(r.jct) for r in rs], 3600, '{:.2f}'):<18} "
                f"{_spread([statistics.median(r.jct) for r in rs], 3600, '{:.2f}'):<18} "
                f"{_spread([_wait(r) for r in rs], 3600, '{:.2f}'):<18} "
                f"{_spread([r.makespan for r in rs], 3600, '{:.1f}'):<18} "
                f"{_spread([r.utilisation for r in rs], 0.01, '{:.0f}%'):<18} "
                f"{statistics.median(r.plans for r in rs):>6.0f}"
            )
        bound = [statistics.fmean(_ideal(r)) for r in results["fcfs"]]
        print(
            f"{cluster:>7}  {'bound':<13} {_spread(bound, 3600, '{:.2f}'):<18} (every job at "
            "max_workers from its arrival: no scheduler's average JCT goes below this)"
        )
        for base in ("fcfs", "fcfs-bf", "policy-rigid"):
            ratios = [
                statistics.fmean(c.jct) / statistics.fmean(b.jct)
                for c, b in zip(results["policy"], results[base], strict=True)
            ]
            print(
                f"{cluster:>7}  avg JCT policy / {base}: {_spread(ratios, fmt='{:.2f}')} "
                f"(goal <= 0.70 vs fcfs)"
            )
    print(f"wall time {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
