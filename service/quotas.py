"""Limits per user: how many jobs, workers, CPUs and GPUs a user's active jobs may hold
together, and how long one job may run. The service's settings give the defaults; an admin
sets them per user (``PUT /v1/users/{name}/limits``). Workers and GPUs are the scheduler's
quotas (a job over them waits in the queue); the others are checked at submission: a job
that could never be admitted under them is a 422, one that must wait for the user's other
jobs to end is a 429."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from jobs.spec import JobSpec, priority_value
from service.problems import Problem
from service.settings import Settings


@dataclass(frozen=True)
class UserLimits:
    max_active_jobs: int
    max_workers: int | None
    max_cpus: float | None
    max_gpus: int | None
    max_wall_time_s: float | None
    code_submission: bool = True

    @classmethod
    def of(cls, settings: Settings, overrides: Mapping[str, Any] | None = None) -> UserLimits:
        limits = cls(
            max_active_jobs=settings.user_max_active_jobs,
            max_workers=settings.user_max_workers,
            max_cpus=settings.user_max_cpus,
            max_gpus=settings.user_max_gpus,
            max_wall_time_s=settings.user_max_wall_time_s,
            code_submission=settings.code_submission,
        )
        return replace(limits, **{k: v for k, v in (overrides or {}).items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def quota(self) -> dict[str, float | None]:
        """The scheduler's quota of these limits: workers and GPUs held at once."""
        return {"workers": self.max_workers, "gpus": self.max_gpus}


@dataclass(frozen=True)
class Usage:
    """What jobs hold at their largest size (each may grow to its max_workers)."""

    jobs: int = 0
    workers: int = 0
    cpus: float = 0.0
    gpus: int = 0

    @classmethod
    def of(cls, spec: JobSpec) -> Usage:
        return cls.of_stored(spec.model_dump(mode="json"))

    @classmethod
    def of_stored(cls, spec: Mapping[str, Any]) -> Usage:
        """From a stored spec's JSON, as it was admitted (today's checks may be stricter)."""
        scaling = spec.get("scaling") or {}
        n = int(scaling.get("max_workers", 1))
        cpus = float(scaling.get("cpus_per_worker", 1.0))
        return cls(1, n, n * cpus, n * int(scaling.get("gpus_per_worker", 0)))

    @classmethod
    def total(cls, specs: Iterable[Mapping[str, Any]]) -> Usage:
        out = cls()
        for spec in specs:
            out = out + cls.of_stored(spec)
        return out

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.jobs + other.jobs,
            self.workers + other.workers,
            self.cpus + other.cpus,
            self.gpus + other.gpus,
        )


def check(user: str, limits: UserLimits, held: Usage, spec: JobSpec) -> None:
    """Refuse ``spec`` for ``user``, who holds ``held`` already, when a limit says so: first
    what the job could never get (422), then what it must wait for (429).

    ``max_workers`` and ``max_gpus`` are the scheduler's quotas, not admission limits: a
    job over them is accepted and waits in ``queued`` (or runs on capacity the scheduler
    lends), so they refuse only a job whose ``min_workers`` alone is over them. ``max_cpus``
    has no counterpart in the scheduler's quotas (workers and GPUs), so it still refuses here,
    counted at max_workers; ``max_active_jobs`` bounds what one user puts in the queue."""
    for limit, need, field in (
        ("max_workers", spec.scaling.min_workers, "scaling.min_workers"),
        (
            "max_gpus",
            spec.scaling.min_workers * spec.scaling.gpus_per_worker,
            "scaling.min_workers",
        ),
    ):
        cap = getattr(limits, limit)
        if cap is not None and need > cap:
            noun = "workers" if limit == "max_workers" else "GPUs"
            _never(user, limit, field, cap, f"the job needs {need:g} {noun} at min_workers")
    wants = Usage.of(spec)
    if limits.max_cpus is not None and wants.cpus > limits.max_cpus:
        what = f"the job holds up to {wants.cpus:g} CPUs at max_workers"
        _never(user, "max_cpus", "scaling.cpus_per_worker", limits.max_cpus, what)
    if held.jobs + 1 > limits.max_active_jobs:
        raise Problem(
            429,
            "User limit reached",
            f"max_active_jobs: {user} has {held.jobs} queued or running jobs, the most "
            f"allowed; submit this one when one ends",
            limit="max_active_jobs",
        )
    if limits.max_cpus is not None and held.cpus + wants.cpus > limits.max_cpus:
        raise Problem(
            429,
            "User limit reached",
            f"max_cpus: {user}'s active jobs hold {held.cpus:g} of {limits.max_cpus:g} CPUs, "
            f"and this job needs up to {wants.cpus:g}; submit it when one ends",
            limit="max_cpus",
        )


def _never(user: str, limit: str, field: str, cap: float, what: str) -> None:
    message = f"{what}, over {user}'s limit {limit} of {cap:g}"
    raise Problem(
        422,
        "Over a user limit",
        f"{field}: {message}",
        errors=[{"field": field, "message": message}],
        limit=limit,
    )


def code_allowed(limits: UserLimits) -> bool:
    """Whether the user may submit code of their own (upload packages, run jobs on them)."""
    return limits.code_submission


def check_code_allowed(user: str, limits: UserLimits) -> None:
    """403 naming the ``code_submission`` field when the user may not submit code: the
    upload route and job submission answer alike."""
    if code_allowed(limits):
        return
    message = f"code submission is turned off for {user}"
    raise Problem(
        403,
        "Code submission not allowed",
        f"code_submission: {message}",
        errors=[{"field": "code_submission", "message": message}],
        limit="code_submission",
    )


# The highest priority an ordinary user may give a job.
USER_MAX_PRIORITY = priority_value("normal")


def check_priority(user: str, is_admin: bool, spec: JobSpec) -> None:
    """Only an admin may put a job above "normal": a priority above it preempts other
    users' jobs, which is the admins' call, not each user's."""
    if is_admin or spec.priority_value <= USER_MAX_PRIORITY:
        return
    message = (
        f"{spec.priority!r} is above normal ({USER_MAX_PRIORITY}); only an admin may submit "
        "a job above normal"
    )
    raise Problem(
        403,
        "Priority not allowed",
        f"priority: {message}",
        errors=[{"field": "priority", "message": message}],
        limit="priority",
    )


def scheduler_quotas(
    settings: Settings, overrides: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, float | None]]:
    """What the scheduler is told (``set_quotas``): each user with limits set, and the
    default under "*" for every owner not named."""
    quotas = {"*": UserLimits.of(settings).quota()}
    for user, limits in sorted(overrides.items()):
        quotas[user] = UserLimits.of(settings, limits).quota()
    return quotas
