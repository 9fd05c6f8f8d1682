"""Limits per user: how many jobs, workers, CPUs and GPUs a user's active jobs may hold
together, and how long one job may run. The service's settings give the defaults; an admin
sets them per user (``PUT /v1/users/{name}/limits``). A job that could never be admitted
under them is a 422; one that must wait for the user's other jobs to end is a 429."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from jobs.spec import JobSpec
from service.problems import Problem
from service.settings import Settings


@dataclass(frozen=True)
class UserLimits:
    max_active_jobs: int
    max_workers: int | None
    max_cpus: float | None
    max_gpus: int | None
    max_wall_time_s: float | None

    @classmethod
    def of(cls, settings: Settings, overrides: Mapping[str, Any] | None = None) -> UserLimits:
        limits = cls(
            max_active_jobs=settings.user_max_active_jobs,
            max_workers=settings.user_max_workers,
            max_cpus=settings.user_max_cpus,
            max_gpus=settings.user_max_gpus,
            max_wall_time_s=settings.user_max_wall_time_s,
        )
        return replace(limits, **{k: v for k, v in (overrides or {}).items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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


# limit -> (what it counts in Usage, the spec field that asks for it, a name for people)
_TOTALS = (
    ("max_workers", "workers", "scaling.max_workers", "workers"),
    ("max_cpus", "cpus", "scaling.cpus_per_worker", "CPUs"),
    ("max_gpus", "gpus", "scaling.gpus_per_worker", "GPUs"),
)


def check(user: str, limits: UserLimits, held: Usage, spec: JobSpec) -> None:
    """Refuse ``spec`` for ``user``, who holds ``held`` already, when a limit says so: first
    what the job could never get (422), then what it must wait for (429)."""
    wants = Usage.of(spec)
    for limit, counted, field, noun in _TOTALS:
        cap, need = getattr(limits, limit), getattr(wants, counted)
        if cap is not None and need > cap:
            message = (
                f"the job holds up to {need:g} {noun} at max_workers, over {user}'s limit "
                f"{limit} of {cap:g}"
            )
            raise Problem(
                422,
                "Over a user limit",
                f"{field}: {message}",
                errors=[{"field": field, "message": message}],
                limit=limit,
            )
    if held.jobs + 1 > limits.max_active_jobs:
        raise Problem(
            429,
            "User limit reached",
            f"max_active_jobs: {user} has {held.jobs} queued or running jobs, the most "
            f"allowed; submit this one when one ends",
            limit="max_active_jobs",
        )
    for limit, counted, _, noun in _TOTALS:
        cap, need = getattr(limits, limit), getattr(wants, counted)
        if cap is not None and getattr(held, counted) + need > cap:
            raise Problem(
                429,
                "User limit reached",
                f"{limit}: {user}'s active jobs hold {getattr(held, counted):g} of {cap:g} "
                f"{noun}, and this job needs up to {need:g}; submit it when one ends",
                limit=limit,
            )
