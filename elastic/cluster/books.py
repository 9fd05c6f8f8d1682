"""The cluster scheduler's books: every job that asked for workers, the owners' quotas, and
the decision in force for each job. The shared actor (``elastic/cluster/capacity.py``) keeps one and
asks it to plan again on every change; it holds no Ray and no clock, so the books are
unit-tested like the policy (``elastic/cluster/scheduling.py``) they apply.

A decision is booked the moment it is made: the workers a job is told to start with are
counted as its own before it starts, so no other job is told it may take them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from elastic.cluster.scheduling import (
    Change,
    Demand,
    JobRecord,
    Knobs,
    Placement,
    Quota,
    plan,
    queue_page,
    waiting_order,
)

DEFAULT_OWNER = "*"  # the quota of an owner the service named no quota for


class SchedulerBook:
    def __init__(self, knobs: Knobs | None = None) -> None:
        self.knobs = knobs or Knobs()
        self.jobs: dict[str, JobRecord] = {}
        self.quotas: dict[str, Quota] = {}
        # The decision in force for each job: the last one that changed its size, so that a
        # supervisor that looks late still learns why (a later plan says only "keep").
        self.decisions: dict[str, Placement] = {}
        self.placements: dict[str, Placement] = {}
        # The queued jobs the service booked that no supervisor has taken over yet: a job
        # waits as a row in the service's store and an entry here, and gets a supervisor
        # only once it is told to start.
        self.rows: set[str] = set()
        # The waiting jobs in queue order, as of the last plan: ``view`` is read far more
        # often than the books change, and sorting 1 000 waiting jobs on every read of one
        # page kept the scheduler's actor from its other callers.
        self._waiting: list[JobRecord] | None = None

    def register(self, demand: Demand, now: float) -> None:
        """A job's supervisor asks for workers (again, when the supervisor was re-created:
        what was measured of the job is kept; or for the first time, for the row it takes
        over)."""
        self.rows.discard(demand.job_id)
        self._waiting = None
        old = self.jobs.get(demand.job_id)
        if old is None:
            self.jobs[demand.job_id] = JobRecord(demand, 0, now)
        else:
            old.demand = demand

    def hold_rows(self, demands: Sequence[Demand], now: float) -> bool:
        """The service's queued jobs that have no supervisor, all of them: each is booked
        (a job already booked keeps its record), and a row no longer given (cancelled, or
        failed) is unbooked. True when the books changed."""
        given = {d.job_id: d for d in demands}
        changed = False
        for gone in self.rows - given.keys():
            changed |= self.unregister(gone)
        for job_id, demand in given.items():
            if job_id not in self.jobs:
                self.jobs[job_id] = JobRecord(demand, 0, now)
                self.rows.add(job_id)
                changed = True
        if changed:
            self._waiting = None
        return changed

    def supervised(self, job_id: str) -> bool:
        """Whether a supervisor asks for this job's workers (not only the service's row)."""
        return job_id in self.jobs and job_id not in self.rows

    def unregister(self, job_id: str) -> bool:
        self.decisions.pop(job_id, None)
        self.placements.pop(job_id, None)
        self.rows.discard(job_id)
        self._waiting = None
        return self.jobs.pop(job_id, None) is not None

    def observe(self, job_id: str, world_size: int, samples_per_s: float) -> None:
        record = self.jobs.get(job_id)
        if record is not None and world_size > 0 and samples_per_s > 0:
            record.throughput[world_size] = samples_per_s

    def set_quotas(self, quotas: Mapping[str, Mapping[str, float | None]]) -> None:
        self.quotas = {
            owner: Quota(
                workers=None if q.get("workers") is None else int(q["workers"] or 0),
                gpus=q.get("gpus"),
            )
            for owner, q in quotas.items()
        }

    def replan(self, nodes: Sequence[Mapping[str, float]], now: float) -> bool:
        """Decide every job's size on these nodes (alive, not draining; their total
        resources). True when any job's decision changed."""
        self._waiting = None
        if not self.jobs:
            self.placements = {}
            return False
        records, quotas = list(self.jobs.values()), self._quotas_by_owner()
        placements = plan(nodes, records, quotas, now, self.knobs)
        if all(p.size > 0 for p in placements.values()):
            placements = _fill_idle(nodes, records, quotas, now, self.knobs, placements)
        changed = False
        for job_id, placement in placements.items():
            record = self.jobs[job_id]
            # Which of an owner's workers are lent: the next plan takes those back first.
            record.borrowed = placement.borrowed
            if placement.size != record.size:
                record.size, record.changed_at = placement.size, now
                self.decisions[job_id] = placement
                changed = True
            elif job_id not in self.decisions or (
                self.decisions[job_id].change is Change.WAIT
                and placement.reason != self.decisions[job_id].reason
            ):
                # A waiting job's reason (its place in the queue) is news for it too; a
                # preemption's stays until its size changes (its supervisor may not have
                # acted on it yet, and says why it went back to the queue).
                self.decisions[job_id] = placement
                changed = True
        self.placements = placements
        return changed

    def target(self, job_id: str) -> Placement | None:
        """The size this job should have, and why; None for a job that never registered."""
        return self.decisions.get(job_id)

    def view(self, after_position: int = 0, limit: int | None = None) -> dict[str, Any]:
        """What ``GET /v1/queue`` shows (the format of ``MembershipWatcher.queue``): the
        waiting entries after ``after_position``, at most ``limit`` of them."""
        if self._waiting is None:
            # Only jobs the last plan placed: one booked since waits for the next plan.
            planned = (r for r in self.jobs.values() if r.demand.job_id in self.placements)
            self._waiting = waiting_order(planned, self.placements)
        page = queue_page(self._waiting, self.placements, after_position, limit)
        running = [
            {
                "job_id": r.demand.job_id,
                "owner": r.demand.owner,
                "priority": r.demand.priority,
                "size": r.size,
                "borrowed": self.placements[r.demand.job_id].borrowed
                if r.demand.job_id in self.placements
                else 0,
                "min_workers": r.demand.min_workers,
                "max_workers": r.demand.max_workers,
            }
            for r in self.jobs.values()
            if r.size > 0
        ]
        return {
            # vars, not asdict: asdict deep-copies every field, the most of a page's cost.
            "queue": [dict(vars(e)) for e in page],
            "waiting": len(self._waiting),
            "running": sorted(running, key=lambda r: (-r["priority"], r["job_id"])),
            "quotas": {o: asdict(q) for o, q in self.quotas.items()},
        }

    def _quotas_by_owner(self) -> dict[str, Quota]:
        default = self.quotas.get(DEFAULT_OWNER)
        quotas = {}
        for record in self.jobs.values():
            owner = record.demand.owner
            quota = self.quotas.get(owner, default)
            if quota is not None:
                quotas[owner] = quota
        return quotas


def _fill_idle(
    nodes: Sequence[Mapping[str, float]],
    records: list[JobRecord],
    quotas: Mapping[str, Quota],
    now: float,
    knobs: Knobs,
    placements: dict[str, Placement],
) -> dict[str, Placement]:
    """With nobody waiting, workers idle because no job's measured throughput gains from
    them go to the jobs below their max_workers after all: a job alone on an idle cluster
    grows back to its max when capacity returns, whatever a noisy measurement said. The
    same plan with every curve unknown (each job looks scalable) gives them; taken only
    when it shrinks nobody, so it moves no worker between jobs."""
    blind = [replace(r, throughput={}) for r in records]
    filled = plan(nodes, blind, quotas, now, knobs)
    if any(filled[j].size < p.size for j, p in placements.items()):
        return placements
    return filled
