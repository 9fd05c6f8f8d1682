"""The service's scheduling policy, a pure function of the facts: given the cluster's nodes,
every job's demand (priority, owner, [min_workers, max_workers], resources per worker), the
size each holds now, its measured throughput per world size, and the owners' quotas, it
decides the size every job should have. No Ray, no clock of its own, no I/O: the cluster's
one scheduler (``elastic/cluster/capacity.py``'s shared actor) calls it on every change, and the
trace benchmark (``bench/scheduler_trace.py``) runs it on a simulated cluster.

The order of decisions:

1. Every job's ``min_workers``, highest priority first; within a priority, first come first
   served, running jobs before waiting ones of the same priority. A waiting job that cannot
   have its minimum is skipped (others behind it may start) unless it has waited longer than
   ``Knobs.starvation_s``: then nothing at its priority or below starts ahead of it.
   A running job loses its minimum (is preempted, size 0) only to a job of strictly higher
   priority, and only after every lower-priority job's extra workers were taken first.
2. Extra workers (up to ``max_workers``), level by level from the highest priority; within
   a level each next worker goes to the job whose throughput it raises most (its measured
   curve, normalised per worker), held workers counting ``1 + Knobs.hysteresis`` times so
   that sizes do not flap.
3. Quotas: steps 1 and 2 run first within every owner's quota; what is left is lent to jobs
   over their owner's quota (borrowed), and taken back first when anyone within quota needs it.

Every allocation packs into the nodes (each worker within one node).

Where the rules above leave room, this module chooses:

- A starving job holds back only jobs that need a resource it is short of (a CPU-only job may
  still start while a GPU job waits for GPUs), and its owner's later jobs, so that they do
  not take the quota it will need. A job starving for its owner's quota (that could hold it)
  holds back its owner's later jobs. A job whose minimum packs into no empty cluster waits
  without holding anyone back. A running job's minimum is never taken by a block.
- Borrowed workers are the ones a job already borrowed (``JobRecord.borrowed``, recorded
  from ``Placement.borrowed``); a job running only on borrowed workers still queues for its
  quota, and its start does not make another of its owner's jobs the borrower.
- ``dwell_s`` holds a job's workers against throughput moves (and quota-free shrinking for
  another's throughput) after any change; growing into workers no one values more is not
  held back (a grow after a grow is no flap).
- Throughput is compared as the marginal gain of one more worker in units of the job's own
  per-worker rate at its smallest measured size (``marginal_gain``), so jobs of different
  samples/s compare; an unmeasured job is assumed to scale linearly, so it is explored.
- ``plan`` iterates to its own fixpoint: planning again with its result applied (sizes,
  ``changed_at = now``, borrowed) keeps everyone (no flapping from order effects).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

# Named priority classes a job spec may give instead of a number.
PRIORITY_CLASSES: dict[str, int] = {"low": 0, "normal": 50, "high": 100}
DEFAULT_PRIORITY = PRIORITY_CLASSES["normal"]


@dataclass(frozen=True)
class Demand:
    """What a job asks of the cluster; fixed for its life."""

    job_id: str
    owner: str
    priority: int
    min_workers: int
    max_workers: int
    per_worker: Mapping[str, float]  # Ray resources per worker: {"CPU": 1}, {"GPU": 1, ...}
    submitted_at: float  # seconds, the same clock as ``now``
    # How a resize happens: "in_place" (survivors train on; cheap) or "restart" (a pause
    # at a checkpoint and a restart on the warm workers; seconds).
    resize: str = "restart"


@dataclass
class JobRecord:
    """The scheduler's record of one job."""

    demand: Demand
    size: int = 0  # workers it holds now; 0 while it waits
    changed_at: float = 0.0  # when ``size`` last changed
    # Measured samples/s at each world size it ran at (the latest measurement per size).
    throughput: dict[int, float] = field(default_factory=dict)
    # Of ``size``, the workers beyond its owner's quota (the last Placement.borrowed,
    # recorded back): they stay the borrowed ones, so that which of an owner's jobs is
    # within quota does not swap when a borrower starts running.
    borrowed: int = 0


@dataclass(frozen=True)
class Quota:
    """Concurrent workers and GPUs an owner's jobs may hold within quota (None: no limit)."""

    workers: int | None = None
    gpus: float | None = None


class Change(StrEnum):
    KEEP = "keep"  # size unchanged (running or waiting)
    START = "start"  # from waiting to running
    GROW = "grow"
    SHRINK = "shrink"
    PREEMPT = "preempt"  # from running to waiting
    WAIT = "wait"  # still waiting


@dataclass(frozen=True)
class Placement:
    """The size a job should have, and why (the text of the job's event or waiting reason)."""

    job_id: str
    size: int  # 0: it waits (queued)
    change: Change
    reason: str  # e.g. "shrunk for job j-2 (priority high)", "grew into idle capacity",
    # "waiting: alice's quota of 4 workers is in use", "waiting behind 2 jobs of priority 100"
    for_job: str | None = None  # the job a shrink or preemption made room for
    borrowed: int = 0  # workers beyond the owner's quota (taken back first)
    # Whether its minimum packs into the live cluster were it empty: a job that cannot (its
    # nodes were lost) is short of capacity, not held back by the queue.
    fits: bool = True


@dataclass(frozen=True)
class Knobs:
    hysteresis: float = 0.25
    starvation_s: float = 600.0
    # A job resized for throughput is not resized again for throughput before this
    # (resizes for minimums, priorities and quotas are not held back).
    dwell_s: float = 60.0
    # False: a running job keeps the size it started at (it still loses it to preemption);
    # the trace benchmark's "sizes chosen at start only" baseline.
    resize_running: bool = True


def plan(
    nodes: Sequence[Mapping[str, float]],
    jobs: Sequence[JobRecord],
    quotas: Mapping[str, Quota],
    now: float,
    knobs: Knobs = Knobs(),
) -> dict[str, Placement]:
    """The size of every job in ``jobs`` (keyed by job id). ``nodes``: each live node's
    total schedulable resources (draining nodes left out)."""
    # The decisions depend a little on what is held (running jobs go first, held workers
    # count more, recent changes dwell, packing keeps held workers in place), so the plan
    # for the records with this plan applied can differ. Iterate to a fixpoint (it takes
    # one or two rounds) so that planning again with the result applied keeps everyone.
    order = _solve(nodes, jobs, quotas, now, knobs)
    for _ in range(_FIXPOINT_ROUNDS):
        # The records as the caller will hold them once this plan is applied.
        sized = {j.rec.demand.job_id: j for j in order}
        records = [_applied(r, sized[r.demand.job_id], now) for r in jobs]
        again = _solve(nodes, records, quotas, now, knobs)
        if all(_same(j, sized[j.rec.demand.job_id]) for j in again):
            break
        order = again
    # The changes are relative to what the caller's records hold.
    by_id = {r.demand.job_id: r for r in jobs}
    for j in order:
        j.rec = by_id[j.rec.demand.job_id]
    return {j.rec.demand.job_id: replace(_placement(j, order), fits=j.fits_empty) for j in order}


_FIXPOINT_ROUNDS = 3


def _solve(
    nodes: Sequence[Mapping[str, float]],
    jobs: Sequence[JobRecord],
    quotas: Mapping[str, Quota],
    now: float,
    knobs: Knobs,
) -> list[_Job]:
    state = _State(nodes, jobs, quotas, now, knobs)
    order = state.jobs  # already in decision order
    # Pass A within every owner's quota, then pass B lends what is left (borrowed).
    for within_quota in (True, False):
        _minimums(state, order, within_quota)
        _extras(state, order, within_quota)
        if within_quota:
            for j in order:
                j.quota_size = j.size
    return order


def _same(a: _Job, b: _Job) -> bool:
    return a.size == b.size and a.quota_size == b.quota_size


def _applied(rec: JobRecord, j: _Job, now: float) -> JobRecord:
    """The record as the caller will hold it once the plan is applied."""
    changed = rec.changed_at if j.size == rec.size else now
    return replace(rec, size=j.size, changed_at=changed, borrowed=j.size - j.quota_size)


# -- throughput curves ---------------------------------------------------------------------


def estimate(throughput: Mapping[int, float], n: int) -> float:
    """Samples/s at world size ``n`` from the measured points. Between measured sizes:
    interpolated. Past the largest: the last measured marginal slope, never below the
    largest measured value (no negative gains from noise). Below the smallest: with one
    point, linear through the origin (an unmeasured job looks perfectly scalable and gets
    explored); with two or more, Amdahl's law fitted through the two smallest, so that a job
    measured as flat at 2 and 3 workers is not thought to gain from a second one."""
    points = sorted((k, v) for k, v in throughput.items() if k > 0)
    if n <= 0:
        return 0.0
    if not points:
        return float(n)
    k0, v0 = points[0]
    if n <= k0:
        if len(points) == 1:
            return v0 * n / k0
        rate, serial = _amdahl(points[0], points[1])
        return rate * n / (1 + serial * (n - 1))
    for (ka, va), (kb, vb) in itertools.pairwise(points):
        if n <= kb:
            return va + (vb - va) * (n - ka) / (kb - ka)
    kl, vl = points[-1]
    if len(points) == 1:
        slope = vl / kl
    else:
        kp, vp = points[-2]
        slope = max(0.0, (vl - vp) / (kl - kp))
    return vl + slope * (n - kl)


def _amdahl(a: tuple[int, float], b: tuple[int, float]) -> tuple[float, float]:
    """(one worker's samples/s, the serial fraction in [0, 1]) of the curve
    ``T(n) = rate * n / (1 + serial * (n - 1))`` through two measured points (``a`` the
    smaller size). Between them the curve rises by a factor from 1 (serial 1: flat) to
    ``kb / ka`` (serial 0: linear); a measured rise outside that range is read as the
    nearest end. A fall (the larger size measured slower: noise, or a step slowed by the
    resize that ended it) is flat, never linear: solving for it directly gives a serial
    fraction below 0, and clamping that made a job with no gain look perfectly scalable."""
    (ka, va), (kb, vb) = a, b
    if va <= _EPS:
        return 0.0, 1.0
    rise = min(max(vb / va, 1.0), kb / ka)
    # rise = kb (1 + s (ka - 1)) / (ka (1 + s (kb - 1))), solved for s; the denominator is
    # at least kb - ka > 0 for rise >= 1.
    serial = (kb - rise * ka) / (rise * ka * (kb - 1) - kb * (ka - 1))
    serial = min(1.0, max(0.0, serial))
    return va * (1 + serial * (ka - 1)) / ka, serial


def marginal_gain(throughput: Mapping[int, float], n: int) -> float:
    """What one more worker (``n`` -> ``n + 1``) adds, in units of one worker's share at
    the smallest measured size, so that jobs of very different samples/s compare."""
    points = sorted((k, v) for k, v in throughput.items() if k > 0)
    unit = points[0][1] / points[0][0] if points else 1.0
    if unit <= 0:
        return 0.0
    return (estimate(throughput, n + 1) - estimate(throughput, n)) / unit


# -- the working state of one plan ---------------------------------------------------------

_EPS = 1e-9
Shape = tuple[float, ...]


@dataclass
class _Job:
    rec: JobRecord
    index: int  # its place in the decision order (ties go to the earlier)
    lo: int  # the fewest workers it may run with in this plan
    hi: int  # the most
    shape: Shape
    gpus: float  # per worker
    size: int = 0
    quota_size: int = 0  # what pass A (within quota) gave it
    fits_empty: bool = True  # its minimum packs into the empty cluster
    wait: str = ""  # why it waits, set when its minimum was refused

    @property
    def held(self) -> int:
        return self.rec.size

    @property
    def priority(self) -> int:
        return self.rec.demand.priority


class _Packer:
    """Workers packed onto nodes, each within one node. Only grows during a plan, so a
    shape that failed once fails again (cached). First fit from a per-shape cursor, over the
    nodes ordered so that a worker goes first to nodes without resources it does not need
    (CPU workers keep off GPU nodes). When that fails but the totals would allow it,
    everything is packed again first-fit decreasing, the workers jobs hold now first (so
    running jobs keep their place), and if that fails too, all by size alone."""

    def __init__(self, nodes: Sequence[Mapping[str, float]], keys: Sequence[str]) -> None:
        self.keys = list(keys)
        self.cap: list[Shape] = [tuple(float(n.get(k, 0.0)) for k in keys) for n in nodes]
        self.free: list[list[float]] = [list(c) for c in self.cap]
        self.counts: dict[tuple[int, bool], int] = {}  # (job index, held?) -> workers
        self.shapes: dict[int, Shape] = {}
        self.held: dict[int, int] = {}
        self.placed: dict[int, int] = {}
        self.cursor: dict[Shape, int] = {}
        self.failed: dict[Shape, int] = {}
        self.orders: dict[Shape, list[int]] = {}
        top = [max((c[d] for c in self.cap), default=0.0) for d in range(len(self.keys))]
        self.top = [t if t > 0 else 1.0 for t in top]

    def add(self, job: int, shape: Shape, held: int, count: int) -> bool:
        if count <= 0:
            return True
        if count >= self.failed.get(shape, 1 << 60):
            return False
        self.shapes[job], self.held[job] = shape, held
        if not self._first_fit(shape, count) and not self._repack(job, count):
            self.failed[shape] = min(count, self.failed.get(shape, 1 << 60))
            return False
        before = self.placed.get(job, 0)
        after = before + count
        in_held = max(0, min(after, held) - min(before, held))
        self.placed[job] = after
        for flag, n in ((True, in_held), (False, count - in_held)):
            if n:
                self.counts[(job, flag)] = self.counts.get((job, flag), 0) + n
        return True

    def short_of(self, shape: Shape, count: int) -> frozenset[int]:
        """The resources whose free total is below ``count`` workers' worth; all that the
        shape needs when the totals suffice (then it is the packing that fails)."""
        needs = [d for d, x in enumerate(shape) if x > 0]
        short = [d for d in needs if sum(f[d] for f in self.free) + _EPS < count * shape[d]]
        return frozenset(short or needs)

    def room(self, shape: Shape) -> int:
        """How many workers of ``shape`` still fit."""
        return sum(_fit_count(f, shape) for f in self.free)

    def order(self, shape: Shape) -> list[int]:
        if shape not in self.orders:
            unused = [
                sum(1 for c, x in zip(cap, shape, strict=True) if c > 0 and x == 0)
                for cap in self.cap
            ]
            self.orders[shape] = sorted(range(len(self.cap)), key=lambda i: (unused[i], i))
        return self.orders[shape]

    def _first_fit(self, shape: Shape, count: int) -> bool:
        start = self.cursor.get(shape, 0)
        order = self.order(shape)
        takes: list[tuple[int, int]] = []
        left = count
        for pos in range(start, len(order)):
            n = min(left, _fit_count(self.free[order[pos]], shape))
            if n:
                takes.append((pos, n))
                left -= n
                if not left:
                    break
        if left:
            return False
        for pos, n in takes:
            i = order[pos]
            self.free[i] = [f - n * s for f, s in zip(self.free[i], shape, strict=True)]
        # Nodes before the first one used had no room for this shape and only fill up.
        self.cursor[shape] = takes[0][0]
        return True

    def _size(self, shape: Shape) -> float:
        return sum(x / t for x, t in zip(shape, self.top, strict=True))

    def _repack(self, job: int, count: int) -> bool:
        shape = self.shapes[job]
        totals = [sum(f[d] for f in self.free) for d in range(len(self.keys))]
        if any(t + _EPS < count * s for t, s in zip(totals, shape, strict=True)):
            return False  # not even the totals allow it
        items = [(held, j, n) for (j, held), n in self.counts.items()]
        extra_held = max(0, min(self.placed.get(job, 0) + count, self.held[job]))
        extra_held -= min(self.placed.get(job, 0), self.held[job])
        items += [(True, job, extra_held), (False, job, count - extra_held)]
        # Held workers first, the largest first within each group (FFD); then all by size.
        for held_first in (True, False):
            items.sort(
                key=lambda t: (held_first and not t[0], -self._size(self.shapes[t[1]]), t[1])
            )
            free = [list(c) for c in self.cap]
            if all(_bulk(free, self.shapes[j], n, self.order(self.shapes[j])) for _, j, n in items):
                self.free = free
                self.cursor = {}
                return True
        return False


def _fit_count(free: Sequence[float], shape: Shape) -> int:
    best = 1 << 30
    for f, s in zip(free, shape, strict=True):
        if s > 0:
            best = min(best, int((f + _EPS) // s))
    return max(0, best)


def _bulk(free: list[list[float]], shape: Shape, count: int, order: Sequence[int]) -> bool:
    for i in order:
        f = free[i]
        if count <= 0:
            break
        n = min(count, _fit_count(f, shape))
        if n:
            free[i] = [a - n * s for a, s in zip(f, shape, strict=True)]
            count -= n
    return count <= 0


class _State:
    def __init__(
        self,
        nodes: Sequence[Mapping[str, float]],
        jobs: Sequence[JobRecord],
        quotas: Mapping[str, Quota],
        now: float,
        knobs: Knobs,
    ) -> None:
        keys = sorted(
            {k for n in nodes for k in n} | {k for r in jobs for k in r.demand.per_worker}
        )
        self.now, self.knobs, self.quotas = now, knobs, quotas
        self.packer = _Packer(nodes, keys)
        empty = _Packer(nodes, keys)
        room_when_empty: dict[Shape, int] = {}  # jobs share a few shapes: one count each
        ordered = sorted(jobs, key=_order_key_of)
        self.jobs: list[_Job] = []
        for i, rec in enumerate(ordered):
            d = rec.demand
            lo, hi = max(1, d.min_workers), max(1, d.min_workers, d.max_workers)
            if rec.size > 0 and not knobs.resize_running:
                lo = hi = rec.size  # rigid once started
            shape = tuple(float(d.per_worker.get(k, 0.0)) for k in keys)
            job = _Job(rec, i, lo, hi, shape, float(d.per_worker.get("GPU", 0.0)))
            if shape not in room_when_empty:
                room_when_empty[shape] = empty.room(shape)
            job.fits_empty = room_when_empty[shape] >= lo
            self.jobs.append(job)
        self.used: dict[str, list[float]] = {}  # owner -> [workers, GPUs] within quota
        # The first job starving for capacity, and per owner the first starving for its
        # owner's quota, each with the resources it is short of: nothing at its priority or
        # below (of that owner) that needs those starts ahead of it.
        self.starving: tuple[_Job, frozenset[int]] | None = None
        self.owner_blocks: dict[str, tuple[_Job, frozenset[int]]] = {}

    def quota_room(self, job: _Job, count: int) -> str:
        """'' if ``count`` more workers stay within the owner's quota, else the reason."""
        owner = job.rec.demand.owner
        q = self.quotas.get(owner)
        if q is None:
            return ""
        used = self.used.get(owner, [0.0, 0.0])
        if q.workers is not None and used[0] + count > q.workers + _EPS:
            return f"waiting: {owner}'s quota of {_workers(q.workers)} is in use"
        if q.gpus is not None and used[1] + count * job.gpus > q.gpus + _EPS:
            return f"waiting: {owner}'s quota of {q.gpus:g} GPUs is in use"
        return ""

    def give(self, job: _Job, count: int, within_quota: bool) -> bool:
        """Add ``count`` workers to ``job`` if they pack (and stay within quota in pass A)."""
        if within_quota and self.quota_room(job, count):
            return False
        if not self.packer.add(job.index, job.shape, job.held, count):
            return False
        job.size += count
        if within_quota:
            used = self.used.setdefault(job.rec.demand.owner, [0.0, 0.0])
            used[0] += count
            used[1] += count * job.gpus
        return True


def _order_key_of(rec: JobRecord) -> tuple[int, int, float, str]:
    # Highest priority first; running before waiting (a waiting job never displaces a
    # running one of its own priority; a job running only on borrowed workers counts as
    # waiting for its quota); then first come first served.
    d = rec.demand
    return (-d.priority, 0 if rec.size > rec.borrowed else 1, d.submitted_at, d.job_id)


def _waited(job: _Job, now: float) -> float:
    # A preempted job waits again from its preemption; its FCFS place stays its submission.
    return now - max(job.rec.demand.submitted_at, job.rec.changed_at if job.held == 0 else 0.0)


# -- step 1: minimums ----------------------------------------------------------------------


def _minimums(state: _State, order: Sequence[_Job], within_quota: bool) -> None:
    for job in order:
        if job.size > 0:
            continue
        if not job.fits_empty:
            job.wait = f"waiting: needs {_workers(job.lo)}, more than the cluster can hold"
            continue
        blocker = _blocked_by(state, job)
        if blocker:
            job.wait = f"waiting: job {blocker} has waited longest and starts first"
            continue
        reason = state.quota_room(job, job.lo) if within_quota else ""
        if reason:
            job.wait = reason
            if within_quota and _starving(state, job) and _quota_can_hold(state, job):
                # Its owner's other jobs must not keep taking the quota ahead of it.
                dims = _uses(job) if "GPUs" not in reason else _uses(job, "GPU", state)
                state.owner_blocks.setdefault(job.rec.demand.owner, (job, dims))
            continue
        room = state.packer.room(job.shape)
        if state.give(job, job.lo, within_quota):
            job.wait = ""
            continue
        if within_quota or not job.wait:
            job.wait = _capacity_reason(state, job, order, min(room, job.lo))
        if within_quota and _starving(state, job) and state.starving is None:
            # From now on nothing at its priority or below that needs what it is short of
            # starts ahead of it (a job needing only idle CPUs may still start).
            state.starving = (job, state.packer.short_of(job.shape, job.lo))
            # Its owner's later jobs must not take the quota it will need either.
            dims = _quota_dims(state, job)
            if dims:
                state.owner_blocks.setdefault(job.rec.demand.owner, (job, dims))


def _queued(job: _Job) -> bool:
    """Waiting, or running only on borrowed workers (still waiting for its quota)."""
    return job.held == 0 or job.rec.borrowed >= job.held


def _starving(state: _State, job: _Job) -> bool:
    return _queued(job) and _waited(job, state.now) > state.knobs.starvation_s


def _blocked_by(state: _State, job: _Job) -> str:
    """The id of the starving job that ``job`` (waiting) may not start ahead of, or ''."""
    if job.held > 0:
        return ""  # a running job keeps its minimum; blocks only hold back starts
    for block in (state.starving, state.owner_blocks.get(job.rec.demand.owner)):
        if block is None:
            continue
        s, dims = block
        if s is not job and job.priority <= s.priority and dims & _uses(job):
            return s.rec.demand.job_id
    return ""


def _uses(job: _Job, only: str | None = None, state: _State | None = None) -> frozenset[int]:
    """The indices of the resources a worker of ``job`` needs (or just ``only``'s)."""
    if only is not None and state is not None and only in state.packer.keys:
        return frozenset({state.packer.keys.index(only)})
    return frozenset(i for i, x in enumerate(job.shape) if x > 0)


def _quota_dims(state: _State, job: _Job) -> frozenset[int]:
    """The resources its owner's quota limits, as they concern ``job``."""
    q = state.quotas.get(job.rec.demand.owner)
    if q is None:
        return frozenset()
    if q.workers is not None:
        return _uses(job)
    return _uses(job, "GPU", state) if q.gpus is not None and job.gpus > 0 else frozenset()


def _quota_can_hold(state: _State, job: _Job) -> bool:
    q = state.quotas.get(job.rec.demand.owner)
    if q is None:
        return True
    workers_ok = q.workers is None or job.lo <= q.workers
    return workers_ok and (q.gpus is None or job.lo * job.gpus <= q.gpus + _EPS)


def _capacity_reason(state: _State, job: _Job, order: Sequence[_Job], free: int) -> str:
    # ``order`` starts with the higher priorities: only that prefix is counted, so that a
    # long queue of one priority costs no quadratic scan (1 000 queued jobs: 0.3 s a plan).
    ahead = 0
    for other in order:
        if other.priority <= job.priority:
            break
        ahead += other.size == 0 and other.fits_empty
    if ahead:
        return f"waiting: {ahead} job{'s' if ahead > 1 else ''} of higher priority ahead"
    return f"waiting: only {free} of {_workers(job.lo)} free"


# -- step 2: extra workers -----------------------------------------------------------------


def _extras(state: _State, order: Sequence[_Job], within_quota: bool) -> None:
    for level in sorted({j.priority for j in order}, reverse=True):
        jobs = [j for j in order if j.priority == level and 0 < j.size < j.hi]
        # A job resized within dwell_s keeps what it holds (throughput does not take it).
        for j in jobs:
            held = _held(j, within_quota)
            if state.now - j.rec.changed_at < state.knobs.dwell_s and held > j.size:
                _give_up_to(state, j, min(held, j.hi) - j.size, within_quota)
        _greedy(state, [j for j in jobs if j.size < j.hi], within_quota)


def _give_up_to(state: _State, job: _Job, count: int, within_quota: bool) -> None:
    # One at a time so that a partial amount is given when all of it does not fit.
    for _ in range(count):
        if not state.give(job, 1, within_quota):
            return


def _held(job: _Job, within_quota: bool) -> int:
    """What it holds, of the kind being given: within quota (pass A) or in all (pass B)."""
    return job.held - min(job.held, job.rec.borrowed) if within_quota else job.held


def _gain(state: _State, job: _Job, within_quota: bool) -> float:
    g = marginal_gain(job.rec.throughput, job.size)
    # A worker the job holds counts more, so that noise and small differences don't move it.
    return g * (1 + state.knobs.hysteresis) if job.size < _held(job, within_quota) else g


def _greedy(state: _State, jobs: Sequence[_Job], within_quota: bool) -> None:
    """Each next worker to the job it raises most (Pollux-like); ties to the earlier job. A
    free worker that raises no job's measured throughput stays free (for the next job to
    start at once); one a job holds stays with it unless another job gains from it (a noisy
    measurement must not shrink a job that nobody else needs the workers of)."""
    heap = [(-_gain(state, j, within_quota), j.index, j) for j in jobs]
    heapq.heapify(heap)
    while heap:
        neg, _, job = heapq.heappop(heap)
        adds_nothing = -neg <= _EPS and job.size >= _held(job, within_quota)
        if adds_nothing or not state.give(job, 1, within_quota):
            continue  # adds nothing, or does not fit: this job grows no further
        if job.size < job.hi:
            heapq.heappush(heap, (-_gain(state, job, within_quota), job.index, job))


# -- the placements and their reasons ------------------------------------------------------


def _placement(job: _Job, order: Sequence[_Job]) -> Placement:
    d = job.rec.demand
    old, new = job.held, job.size
    borrowed = max(0, new - job.quota_size)
    lent = f" ({borrowed} borrowed beyond {d.owner}'s quota)" if borrowed else ""
    if new == 0:
        if old == 0:
            return Placement(d.job_id, 0, Change.WAIT, job.wait or "waiting")
        why, for_job = _taken_by(job, order)
        return Placement(d.job_id, 0, Change.PREEMPT, f"preempted{why}", for_job)
    if old == 0:
        return Placement(
            d.job_id, new, Change.START, f"started with {_workers(new)}{lent}", None, borrowed
        )
    if new == old:
        return Placement(
            d.job_id, new, Change.KEEP, f"running with {_workers(new)}{lent}", None, borrowed
        )
    if new > old:
        shrunk = any(o.held > 0 and o.size < o.held for o in order)
        why = "grew: it gains the most throughput" if shrunk else "grew into idle capacity"
        return Placement(d.job_id, new, Change.GROW, why + lent, None, borrowed)
    why, for_job = _taken_by(job, order)
    return Placement(d.job_id, new, Change.SHRINK, f"shrunk{why}{lent}", for_job, borrowed)


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def _taken_by(victim: _Job, order: Sequence[_Job]) -> tuple[str, str | None]:
    """Which job the victim's workers went to, and the reason's text after the verb."""
    gainers = [o for o in order if o.size > o.held]
    for o in gainers:
        if o.priority > victim.priority:
            return f" for job {o.rec.demand.job_id} (priority {o.priority})", o.rec.demand.job_id
    if victim.rec.borrowed > 0:
        # It had borrowed: what it lost went to a job growing within its owner's quota.
        for o in gainers:
            if o.quota_size > o.held - min(o.held, o.rec.borrowed):
                owner = victim.rec.demand.owner
                return (
                    f": {owner}'s borrowed workers taken back for job {o.rec.demand.job_id}",
                    o.rec.demand.job_id,
                )
    for o in gainers:
        if o.held == 0:
            jid = o.rec.demand.job_id
            return f" for job {jid} (priority {o.priority}) to start", jid
    for o in gainers:
        jid = o.rec.demand.job_id
        return f": job {jid} gains more throughput from the workers", jid
    return ": the cluster has less capacity", None


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    owner: str
    priority: int
    position: int  # 1 = next to start
    reason: str
    expected_start_s: float | None  # seconds from now, when knowable


def waiting_order(
    jobs: Iterable[JobRecord], placements: Mapping[str, Placement]
) -> list[JobRecord]:
    """The waiting jobs in the order they would start: ``plan()``'s own order, highest
    priority first, then first come first served."""
    waiting = [r for r in jobs if placements[r.demand.job_id].size == 0]
    waiting.sort(key=lambda r: (-r.demand.priority, r.demand.submitted_at, r.demand.job_id))
    return waiting


def queue(jobs: Sequence[JobRecord], placements: Mapping[str, Placement]) -> list[QueueEntry]:
    """The waiting jobs in the order they would start, each with why it waits. The start
    time is not predicted (None): it depends on when running jobs finish, which the
    scheduler does not know."""
    return queue_page(waiting_order(jobs, placements), placements)


def queue_page(
    waiting: Sequence[JobRecord],
    placements: Mapping[str, Placement],
    after_position: int = 0,
    limit: int | None = None,
) -> list[QueueEntry]:
    """:func:`queue` of an order :func:`waiting_order` gave: only the page's entries are
    built, so that a page of a long queue costs its own length."""
    end = None if limit is None else after_position + limit
    return [
        QueueEntry(
            job_id=r.demand.job_id,
            owner=r.demand.owner,
            priority=r.demand.priority,
            position=i,
            reason=placements[r.demand.job_id].reason,
            expected_start_s=None,
        )
        for i, r in enumerate(waiting[after_position:end], start=after_position + 1)
    ]


def workers_that_fit(
    free_per_node: Iterable[Mapping[str, float]], per_worker: Mapping[str, float]
) -> int:
    """How many workers of ``per_worker`` resources fit, each within a single node."""
    total = 0
    for free in free_per_node:
        fits = min(
            (int(free.get(name, 0.0) // amount) for name, amount in per_worker.items() if amount),
            default=0,
        )
        total += max(0, fits)
    return total
