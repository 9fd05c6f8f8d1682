"""The scheduling policy (elastic/cluster/scheduling.py): named scenarios with exact outcomes, a
randomised cluster simulation checking its invariants at every step, and the trace
benchmark's simulator on a tiny trace (so the benchmark cannot rot)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from elastic.cluster.scheduling import (
    Change,
    Demand,
    JobRecord,
    Knobs,
    Placement,
    Quota,
    estimate,
    marginal_gain,
    plan,
    queue,
)

CPU = {"CPU": 1.0}


def job(
    job_id: str,
    *,
    lo: int,
    hi: int,
    priority: int = 50,
    owner: str = "alice",
    at: float = 0.0,
    size: int = 0,
    changed_at: float = 0.0,
    per_worker: Mapping[str, float] = CPU,
    throughput: dict[int, float] | None = None,
) -> JobRecord:
    demand = Demand(job_id, owner, priority, lo, hi, dict(per_worker), at)
    return JobRecord(demand, size, changed_at, dict(throughput or {}))


def cpu_nodes(*slots: int) -> list[dict[str, float]]:
    return [{"CPU": float(s)} for s in slots]


def sizes(placements: Mapping[str, Placement]) -> dict[str, int]:
    return {k: p.size for k, p in placements.items()}


def linear(n: int, rate: float = 10.0) -> dict[int, float]:
    return {n: rate * n}


# -- priorities ------------------------------------------------------------------------------


def test_a_low_priority_job_shrinks_to_its_minimum_for_a_high_one() -> None:
    low = job("low", lo=4, hi=16, priority=0, size=16, throughput=linear(16))
    high = job("high", lo=8, hi=8, priority=100, at=5)
    out = plan(cpu_nodes(8, 8), [low, high], {}, now=1000)
    assert sizes(out) == {"low": 8, "high": 8}
    assert out["low"].change is Change.SHRINK
    assert out["low"].reason == "shrunk for job high (priority 100)"
    assert out["low"].for_job == "high"
    assert out["high"].change is Change.START


def test_it_is_preempted_only_when_shrinking_to_its_minimum_is_not_enough() -> None:
    low = job("low", lo=4, hi=16, priority=0, size=16, throughput=linear(16))
    high = job("high", lo=14, hi=14, priority=100, at=5)
    out = plan(cpu_nodes(8, 8), [low, high], {}, now=1000)
    assert sizes(out) == {"low": 0, "high": 14}
    assert out["low"].change is Change.PREEMPT
    assert out["low"].reason == "preempted for job high (priority 100)"
    assert [(e.job_id, e.position) for e in queue([low, high], out)] == [("low", 1)]


def test_no_preemption_for_a_high_job_that_would_not_fit_anyway() -> None:
    low = job("low", lo=4, hi=8, priority=0, size=8, throughput=linear(8))
    huge = job("huge", lo=24, hi=24, priority=100, at=5)
    out = plan(cpu_nodes(8, 8), [low, huge], {}, now=1000)
    assert sizes(out) == {"low": 8, "huge": 0}
    assert out["huge"].reason == "waiting: needs 24 workers, more than the cluster can hold"


def test_the_lowest_priority_and_latest_job_is_preempted_first() -> None:
    a = job("a", lo=8, hi=8, priority=0, at=1, size=8)
    b = job("b", lo=8, hi=8, priority=0, at=2, size=8)
    c = job("c", lo=8, hi=8, priority=50, at=0, size=8)
    high = job("high", lo=8, hi=8, priority=100, at=3)
    out = plan(cpu_nodes(8, 8, 8), [a, b, c, high], {}, now=10)
    assert sizes(out) == {"a": 8, "b": 0, "c": 8, "high": 8}


# -- first come first served, backfill, starvation -------------------------------------------


def test_equal_priorities_start_first_come_first_served() -> None:
    first = job("first", lo=8, hi=8, at=1)
    second = job("second", lo=8, hi=8, at=2)
    out = plan(cpu_nodes(8), [second, first], {}, now=10)
    assert sizes(out) == {"first": 8, "second": 0}
    assert out["second"].reason == "waiting: only 0 of 8 workers free"
    # Once it runs, a waiting job of its own priority never displaces it.
    running = replace(first, size=8, changed_at=10)
    earlier = job("earlier", lo=8, hi=8, at=0)
    out = plan(cpu_nodes(8), [running, earlier], {}, now=20)
    assert sizes(out) == {"first": 8, "earlier": 0}


def test_higher_priority_ahead_is_the_waiting_reason() -> None:
    busy = job("busy", lo=8, hi=8, priority=100, size=8)
    h1 = job("h1", lo=8, hi=8, priority=100, at=1)
    h2 = job("h2", lo=8, hi=8, priority=100, at=2)
    n = job("n", lo=4, hi=4, priority=50, at=0)
    out = plan(cpu_nodes(8), [busy, h1, h2, n], {}, now=10)
    assert out["n"].reason == "waiting: 2 jobs of higher priority ahead"
    assert [e.job_id for e in queue([busy, h1, h2, n], out)] == ["h1", "h2", "n"]


def test_small_jobs_backfill_until_the_big_head_job_starves() -> None:
    running = job("running", lo=8, hi=8, size=8, at=0)
    big = job("big", lo=16, hi=16, at=1)
    small = job("small", lo=4, hi=4, at=2)
    knobs = Knobs(starvation_s=600)
    out = plan(cpu_nodes(8, 8), [running, big, small], {}, now=100, knobs=knobs)
    assert sizes(out) == {"running": 8, "big": 0, "small": 4}  # backfilled
    out = plan(cpu_nodes(8, 8), [running, big, small], {}, now=700, knobs=knobs)
    assert sizes(out) == {"running": 8, "big": 0, "small": 0}
    assert out["small"].reason == "waiting: job big has waited longest and starts first"
    # A higher priority job still goes ahead of the starving one.
    urgent = job("urgent", lo=4, hi=4, priority=100, at=650)
    out = plan(cpu_nodes(8, 8), [running, big, small, urgent], {}, now=700, knobs=knobs)
    assert sizes(out)["urgent"] == 4


# -- goodput-aware sharing -------------------------------------------------------------------


def test_spare_workers_go_to_the_job_whose_curve_gains() -> None:
    flat = job("flat", lo=2, hi=8, at=0, size=2, throughput={2: 100.0, 4: 110.0})
    scales = job("scales", lo=2, hi=8, at=1, size=2, throughput={2: 20.0, 4: 40.0})
    out = plan(cpu_nodes(8), [flat, scales], {}, now=1000)
    # flat's next worker adds a tenth of its per-worker rate, scales' a whole one.
    assert sizes(out) == {"flat": 2, "scales": 6}
    assert out["scales"].change is Change.GROW
    assert out["scales"].reason == "grew into idle capacity"


def test_workers_move_to_a_job_that_gains_more_beyond_hysteresis() -> None:
    flat = job("flat", lo=2, hi=8, at=0, size=6, throughput={2: 100.0, 6: 101.0})
    scales = job("scales", lo=2, hi=8, at=1, size=2, throughput={2: 20.0})
    out = plan(cpu_nodes(8), [flat, scales], {}, now=1000)
    assert sizes(out) == {"flat": 2, "scales": 6}
    assert out["flat"].reason == "shrunk: job scales gains more throughput from the workers"
    assert out["scales"].reason == "grew: it gains the most throughput"


def test_a_job_measured_slower_at_its_larger_size_is_flat_not_scalable() -> None:
    """What a whole-suite run measured: "flat" (the same samples/s at any size) was last
    seen at 3 workers in the step slowed by the shrink to 2 that ended it (115 samples/s,
    190 at 2). Below 2 it must look flat, so the worker goes to the job that doubles."""
    assert estimate({2: 190.0, 3: 115.0}, 1) == 190.0
    assert marginal_gain({2: 190.0, 3: 115.0}, 1) == 0.0
    flat = job("flat", lo=1, hi=3, at=0, size=2, throughput={3: 115.0, 2: 190.0})
    gains = job("gains", lo=1, hi=3, at=1, size=1, throughput={1: 187.0})
    out = plan(cpu_nodes(1, 1, 1), [flat, gains], {}, now=1000)
    assert sizes(out) == {"flat": 1, "gains": 2}
    assert out["flat"].reason == "shrunk: job gains gains more throughput from the workers"


def test_hysteresis_keeps_workers_against_a_slightly_better_curve() -> None:
    # a's workers each add 0.85 of its per-worker rate, b's (unmeasured beyond 2) a whole.
    a = job("a", lo=2, hi=8, at=0, size=6, throughput={2: 20.0, 6: 54.0})
    b = job("b", lo=2, hi=8, at=1, size=2, throughput={2: 22.0})
    out = plan(cpu_nodes(8), [a, b], {}, now=1000)
    assert sizes(out) == {"a": 6, "b": 2}  # 0.85 * 1.25 > 1
    out = plan(cpu_nodes(8), [a, b], {}, now=1000, knobs=Knobs(hysteresis=0))
    assert sizes(out) == {"a": 2, "b": 6}


def test_dwell_holds_a_recent_resize_against_throughput_moves() -> None:
    flat = job("flat", lo=2, hi=8, at=0, size=6, changed_at=990, throughput={2: 100.0, 6: 101.0})
    scales = job("scales", lo=2, hi=8, at=1, size=2, throughput={2: 20.0})
    out = plan(cpu_nodes(8), [flat, scales], {}, now=1000, knobs=Knobs(dwell_s=60))
    assert sizes(out) == {"flat": 6, "scales": 2}
    out = plan(cpu_nodes(8), [flat, scales], {}, now=1051, knobs=Knobs(dwell_s=60))
    assert sizes(out) == {"flat": 2, "scales": 6}


def test_unmeasured_sizes_are_estimated() -> None:
    assert estimate({}, 3) == 3.0  # nothing measured: linear
    assert estimate({4: 40.0}, 2) == 20.0  # linear up to the smallest measured size
    assert estimate({4: 40.0}, 8) == 80.0  # one point: linear beyond it (explored)
    assert estimate({2: 20.0, 4: 30.0}, 3) == 25.0  # interpolated
    assert estimate({2: 20.0, 4: 30.0}, 8) == 50.0  # the last marginal slope
    assert estimate({2: 20.0, 4: 15.0}, 8) == 15.0  # never a negative slope
    assert marginal_gain({2: 20.0, 4: 30.0}, 4) == 0.5  # 5 samples/s over 10 per worker
    assert marginal_gain({2: 20.0, 4: 15.0}, 4) == 0.0


# -- quotas -----------------------------------------------------------------------------------


def test_a_job_over_its_owners_quota_waits_with_the_reason() -> None:
    quotas = {"alice": Quota(workers=4)}
    a1 = job("a1", lo=4, hi=4, owner="alice", size=4, at=0)
    bob = job("bob", lo=4, hi=4, owner="bob", size=4, at=1)
    a2 = job("a2", lo=2, hi=2, owner="alice", at=2)
    late = job("late", lo=4, hi=4, owner="carol", at=3)
    out = plan(cpu_nodes(8, 4), [a1, bob, a2, late], quotas, now=10)
    assert sizes(out) == {"a1": 4, "bob": 4, "a2": 0, "late": 4}
    assert out["a2"].reason == "waiting: alice's quota of 4 workers is in use"
    entries = queue([a1, bob, a2, late], out)
    assert [(e.job_id, e.reason, e.expected_start_s) for e in entries] == [
        ("a2", "waiting: alice's quota of 4 workers is in use", None)
    ]


def test_quota_is_borrowed_when_idle_and_taken_back_for_an_owner_within_quota() -> None:
    quotas = {"alice": Quota(workers=4), "bob": Quota(workers=8)}
    alice = job("a", lo=2, hi=16, owner="alice", at=0, throughput=linear(2))
    out = plan(cpu_nodes(8, 8), [alice], quotas, now=10)
    assert out["a"].size == 16 and out["a"].borrowed == 12
    assert out["a"].reason == "started with 16 workers (12 borrowed beyond alice's quota)"
    # The service records each placement's borrowed workers back on the job.
    alice = replace(alice, size=16, changed_at=10, throughput=linear(16), borrowed=12)
    bob = job("b", lo=8, hi=8, owner="bob", at=20)
    out = plan(cpu_nodes(8, 8), [alice, bob], quotas, now=30)
    assert sizes(out) == {"a": 8, "b": 8}  # alice keeps her 4 and 4 borrowed
    assert out["a"].borrowed == 4
    assert out["a"].reason == (
        "shrunk: alice's borrowed workers taken back for job b (4 borrowed beyond alice's quota)"
    )
    # Borrowing never takes a minimum from an owner within quota, whatever the priority.
    urgent = job("a", lo=12, hi=12, owner="alice", priority=100, size=12, throughput=linear(12))
    urgent.borrowed = 8
    out = plan(cpu_nodes(8, 8), [urgent, bob], quotas, now=30)
    assert sizes(out) == {"a": 0, "b": 8}
    assert out["a"].change is Change.PREEMPT


def test_gpu_quotas_count_workers_times_their_gpus() -> None:
    nodes = [{"CPU": 16.0, "GPU": 8.0}]
    two_gpu = {"CPU": 1.0, "GPU": 2.0}
    quotas = {"alice": Quota(gpus=4), "bob": Quota(gpus=4)}
    a = job("a", lo=2, hi=4, owner="alice", per_worker=two_gpu, size=2, throughput=linear(2))
    b = job("b", lo=2, hi=2, owner="bob", per_worker=two_gpu, at=1)
    a2 = job("a2", lo=1, hi=1, owner="alice", per_worker=two_gpu, at=2)
    out = plan(nodes, [a, b, a2], quotas, now=10)
    assert sizes(out) == {"a": 2, "b": 2, "a2": 0}
    assert out["a2"].reason == "waiting: alice's quota of 4 GPUs is in use"


# -- packing ---------------------------------------------------------------------------------


def test_workers_pack_within_nodes_of_different_sizes() -> None:
    nodes = [{"GPU": 8.0}, {"GPU": 4.0}, {"GPU": 2.0}]
    three = job("three", lo=1, hi=8, per_worker={"GPU": 3.0}, throughput=linear(1))
    out = plan(nodes, [three], {}, now=0)
    assert out["three"].size == 3  # 2 on the 8-GPU node, 1 on the 4, none on the 2
    whole = job("whole", lo=4, hi=4, per_worker={"GPU": 4.0})
    out = plan(nodes, [whole], {}, now=0)
    assert out["whole"].reason == "waiting: needs 4 workers, more than the cluster can hold"
    # 14 GPUs free in total, but a 4-GPU worker fits on only 3 of them.
    out = plan(nodes, [replace(whole, demand=replace(whole.demand, min_workers=3))], {}, now=0)
    assert out["whole"].size == 3


def test_packing_repacks_when_first_fit_in_arrival_order_would_fail() -> None:
    # First fit in decision order puts the 3-slot worker on the 6-slot node, leaving no room
    # for the 5-slot one; packing the largest first fits both.
    nodes = cpu_nodes(6, 3)
    three = job("three", lo=1, hi=1, per_worker={"CPU": 3.0}, priority=100, at=0)
    five = job("five", lo=1, hi=1, per_worker={"CPU": 5.0}, at=1)
    out = plan(nodes, [three, five], {}, now=10)
    assert sizes(out) == {"three": 1, "five": 1}


# -- stability -------------------------------------------------------------------------------


def test_planning_again_with_the_result_applied_keeps_everyone() -> None:
    jobs = [
        job("a", lo=1, hi=8, at=0, throughput={1: 10.0, 4: 30.0}, size=4),
        job("b", lo=2, hi=8, at=1, throughput={2: 20.0}, size=2),
        job("c", lo=3, hi=3, at=2, priority=100),
        job("d", lo=8, hi=8, at=3),
    ]
    out = plan(cpu_nodes(8, 4), jobs, {}, now=500)
    again = plan(cpu_nodes(8, 4), apply(jobs, out, 500), {}, now=500)
    assert all(p.change in (Change.KEEP, Change.WAIT) for p in again.values()), again


def apply(jobs: Sequence[JobRecord], out: Mapping[str, Placement], now: float) -> list[JobRecord]:
    applied = []
    for r in jobs:
        p = out[r.demand.job_id]
        changed = r.changed_at if p.size == r.size else now
        applied.append(replace(r, size=p.size, changed_at=changed, borrowed=p.borrowed))
    return applied


# -- a random cluster, thousands of events ---------------------------------------------------

SHAPES: list[dict[str, float]] = [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]
NODE_KINDS: list[dict[str, float]] = [{"CPU": 8.0}, {"CPU": 4.0}, {"CPU": 16.0, "GPU": 4.0}]
MAX_RUN_S = 600.0


def packs(
    nodes: Sequence[Mapping[str, float]], items: Sequence[tuple[Mapping[str, float], int]]
) -> bool:
    """An independent check: first fit decreasing, in a few orders (any packing will do)."""
    for gpu_first in (False, True):
        for spare_gpu_nodes in (False, True):
            if _first_fit(nodes, items, gpu_first, spare_gpu_nodes):
                return True
    return False


def _first_fit(
    nodes: Sequence[Mapping[str, float]],
    items: Sequence[tuple[Mapping[str, float], int]],
    gpu_first: bool,
    spare_gpu_nodes: bool,
) -> bool:
    free = [dict(n) for n in nodes]

    def key(it: tuple[Mapping[str, float], int]) -> tuple[bool, float]:
        return (gpu_first and "GPU" not in it[0], -sum(it[0].values()))

    for shape, count in sorted(items, key=key):
        order = free
        if spare_gpu_nodes and "GPU" not in shape:
            order = sorted(free, key=lambda n: n.get("GPU", 0.0) > 0)
        for node in order:
            while count and all(node.get(k, 0.0) + 1e-9 >= v for k, v in shape.items()):
                for k, v in shape.items():
                    node[k] = node.get(k, 0.0) - v
                count -= 1
        if count:
            return False
    return True


class Sim:
    """A cluster with random arrivals, run times, curves and quotas, planned at every step."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.one_priority = seed % 2 == 1
        self.nodes = [dict(rng.choice(NODE_KINDS)) for _ in range(rng.randint(3, 8))]
        self.quotas = {
            o: Quota(workers=rng.choice([None, 6, 12]), gpus=rng.choice([None, 2.0, 4.0]))
            for o in ("alice", "bob", "carol")
        }
        self.knobs = Knobs(starvation_s=300.0, dwell_s=60.0)
        self.jobs: dict[str, JobRecord] = {}
        self.left_s: dict[str, float] = {}  # run time each job still needs
        self.curve: dict[str, tuple[float, float]] = {}  # (samples/s of one worker, serial)
        self.waiting_since: dict[str, float] = {}
        self.now = 0.0
        self.arrivals = 0
        # The oldest waiting job the bound applies to starts within this of becoming the
        # oldest: it starves after starvation_s, then waits for running jobs to end (twice
        # at most: jobs that need none of what it is short of may start meanwhile).
        self.bound_s = self.knobs.starvation_s + 2 * MAX_RUN_S + 100.0
        self.head: tuple[str, float] | None = None

    def arrive(self) -> None:
        rng = self.rng
        jid = f"j{self.arrivals}"
        self.arrivals += 1
        lo = rng.choice([1, 1, 2, 4])
        priority = 50 if self.one_priority else rng.choice([0, 50, 100])
        record = job(
            jid,
            lo=lo,
            hi=lo * rng.choice([1, 2, 4]),
            priority=priority,
            owner=rng.choice(["alice", "bob", "carol"]),
            at=self.now,
            per_worker=rng.choice(SHAPES),
        )
        self.jobs[jid] = record
        self.left_s[jid] = rng.uniform(30.0, MAX_RUN_S)
        self.curve[jid] = (rng.uniform(10.0, 100.0), rng.choice([0.0, 0.05, 0.3, 0.9]))
        self.waiting_since[jid] = self.now

    def advance(self, dt: float) -> None:
        self.now += dt
        for jid, r in list(self.jobs.items()):
            if r.size > 0:
                self.left_s[jid] -= dt
                if self.left_s[jid] <= 0:
                    del self.jobs[jid]
                    continue
                rate, serial = self.curve[jid]
                n = r.size
                r.throughput[n] = rate * n / (serial * n + 1 - serial) * self.rng.gauss(1, 0.03)

    def bounded(self, r: JobRecord) -> bool:
        """Whether the starvation bound applies: its minimum fits the empty cluster and its
        owner's quota, and no higher priority can arrive."""
        d = r.demand
        q = self.quotas[d.owner]
        gpus = d.min_workers * d.per_worker.get("GPU", 0.0)
        return (
            (self.one_priority or d.priority == 100)
            and packs(self.nodes, [(d.per_worker, d.min_workers)])
            and (q.workers is None or d.min_workers <= q.workers)
            and (q.gpus is None or gpus <= q.gpus)
        )


def check_step(sim: Sim, out: Mapping[str, Placement]) -> None:
    jobs = sim.jobs
    for jid, p in out.items():
        d = jobs[jid].demand
        assert p.size == 0 or d.min_workers <= p.size <= d.max_workers, (jid, p)
        assert 0 <= p.borrowed <= p.size
    items = [(jobs[j].demand.per_worker, p.size) for j, p in out.items()]
    assert packs(sim.nodes, items), "the sizes do not pack into the nodes"
    # Within quota: what is not borrowed stays within each owner's quota.
    used: dict[str, list[float]] = {}
    for jid, p in out.items():
        d = jobs[jid].demand
        u = used.setdefault(d.owner, [0.0, 0.0])
        u[0] += p.size - p.borrowed
        u[1] += (p.size - p.borrowed) * d.per_worker.get("GPU", 0.0)
    for owner, (w, g) in used.items():
        q = sim.quotas[owner]
        assert q.workers is None or w <= q.workers
        assert q.gpus is None or g <= q.gpus + 1e-9
    # Borrowed workers never keep out a job whose owner is within quota: without them its
    # minimum would not pack next to everything held within quota.
    if any(p.borrowed for p in out.values()):
        kept = [(jobs[j].demand.per_worker, p.size - p.borrowed) for j, p in out.items()]
        for jid, p in out.items():
            d = jobs[jid].demand
            if p.size or "waited longest" in p.reason or "more than the cluster" in p.reason:
                continue
            q = sim.quotas[d.owner]
            u = used.get(d.owner, [0.0, 0.0])
            gpus = d.min_workers * d.per_worker.get("GPU", 0.0)
            if (q.workers is not None and u[0] + d.min_workers > q.workers) or (
                q.gpus is not None and u[1] + gpus > q.gpus + 1e-9
            ):
                continue
            borrowers = [
                j for j, b in out.items() if b.borrowed and jobs[j].demand.owner != d.owner
            ]
            if borrowers:
                assert not packs(sim.nodes, [*kept, (d.per_worker, d.min_workers)]), (jid, p)
    # No flapping: a throughput move never undoes a change younger than dwell_s.
    for jid, p in out.items():
        r = jobs[jid]
        if p.change is Change.SHRINK and "gains more throughput" in p.reason:
            assert sim.now - r.changed_at >= sim.knobs.dwell_s, (jid, p)


def check_the_head_starts(sim: Sim) -> None:
    """The oldest waiting job that fits (cluster and quota) at the top priority starts
    within a bound of becoming the oldest: no starvation."""
    waiting = [r for r in sim.jobs.values() if r.size == 0 and sim.bounded(r)]
    if not waiting:
        sim.head = None
        return
    head = min(waiting, key=lambda r: (r.demand.submitted_at, r.demand.job_id)).demand.job_id
    if sim.head is None or sim.head[0] != head:
        sim.head = (head, sim.now)
    assert sim.now - sim.head[1] <= sim.bound_s, (head, sim.now - sim.head[1])


@pytest.mark.parametrize("seed", range(6))
def test_a_random_cluster_keeps_the_invariants_at_every_step(seed: int) -> None:
    sim = Sim(seed)
    for _ in range(600):
        sim.advance(sim.rng.expovariate(1 / 10.0))
        for _ in range(sim.rng.choice([0, 0, 0, 1, 1, 2])):
            sim.arrive()
        jobs = list(sim.jobs.values())
        out = plan(sim.nodes, jobs, sim.quotas, sim.now, sim.knobs)
        check_step(sim, out)
        applied = apply(jobs, out, sim.now)
        again = plan(sim.nodes, applied, sim.quotas, sim.now, sim.knobs)
        flaps = {j: p for j, p in again.items() if p.change not in (Change.KEEP, Change.WAIT)}
        assert not flaps, flaps
        for r in applied:
            jid = r.demand.job_id
            if r.size == 0 and sim.jobs[jid].size > 0:
                sim.waiting_since[jid] = sim.now  # preempted: waits again from now
            sim.jobs[jid] = r
        check_the_head_starts(sim)
    assert sim.arrivals > 330


# -- the trace benchmark's simulator -----------------------------------------------------------


def test_the_trace_simulator_finishes_every_job_with_exactly_its_work() -> None:
    from bench.scheduler_trace import SCHEDULERS, make_trace, simulate

    trace = make_trace(seed=1, cluster=16, jobs=12)
    for name in SCHEDULERS:
        result = simulate(trace, 16, name)
        assert sorted(r.job.job_id for r in result.runs) == sorted(j.job_id for j in trace)
        for r in result.runs:
            assert r.done_at is not None and r.done_at >= r.job.arrival
            # Conservation: processed minus what preemptions lost is the job's work.
            assert r.processed - r.lost == pytest.approx(r.job.work, rel=1e-6), (name, r.job)
        assert 0 < result.utilisation <= 1
