"""The service's scheduling policy, a pure function of the facts: given the cluster's nodes,
every job's demand (priority, owner, [min_workers, max_workers], resources per worker), the
size each holds now, its measured throughput per world size, and the owners' quotas, it
decides the size every job should have. No Ray, no clock of its own, no I/O: the cluster's
one scheduler (``elastic/capacity.py``'s shared actor) calls it on every change, and the
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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Knobs:
    hysteresis: float = 0.25
    starvation_s: float = 600.0
    # A job resized for throughput is not resized again for throughput before this
    # (resizes for minimums, priorities and quotas are not held back).
    dwell_s: float = 60.0


def plan(
    nodes: Sequence[Mapping[str, float]],
    jobs: Sequence[JobRecord],
    quotas: Mapping[str, Quota],
    now: float,
    knobs: Knobs = Knobs(),
) -> dict[str, Placement]:
    """The size of every job in ``jobs`` (keyed by job id). ``nodes``: each live node's
    total schedulable resources (draining nodes left out)."""
    raise NotImplementedError


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    owner: str
    priority: int
    position: int  # 1 = next to start
    reason: str
    expected_start_s: float | None  # seconds from now, when knowable


def queue(jobs: Sequence[JobRecord], placements: Mapping[str, Placement]) -> list[QueueEntry]:
    """The waiting jobs in the order they would start, each with why it waits."""
    raise NotImplementedError
