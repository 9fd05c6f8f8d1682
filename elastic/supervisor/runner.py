"""What the supervisor's loop knows of an attempt: :class:`AttemptSpec` in,
:class:`~elastic.supervisor.attempt.AttemptOutcome` out, through an :class:`AttemptRunner`.

Two runners place work on the cluster: ``elastic/restart/runner.py`` (``restart``: a worker group
on a pool of warm worker actors, a new group per attempt) and ``elastic/in_place/runner.py``
(``in_place``: torchft replicas). This module imports neither Ray nor torch: the supervisor
imports it at start-up.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from elastic.cluster.reservation import Reservation
from elastic.supervisor.attempt import AttemptOutcome


@dataclass(frozen=True)
class AttemptSpec:
    """Everything one attempt needs to start, besides the job's fixed plan."""

    attempt: int
    world_size: int
    resume_path: str | None
    # Nodes the attempt must not use (suspected lost, or draining): a warm worker there is
    # let go rather than trained on.
    avoid: frozenset[str] = frozenset()
    # In place: how many replicas to keep placed, joiners included (None: max_workers).
    replicas: int | None = None


@dataclass(frozen=True)
class RunningAttempt:
    """An attempt whose workers outlived their supervisor (in place: the replicas and their
    lighthouse), for the supervisor re-created after it to adopt."""

    number: int
    world_size: int  # its workers found alive (or waiting for capacity)
    replicas: int  # how many it keeps placed: the scheduler's size for it


class AttemptRunner(Protocol):
    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        """Start the attempt and wait for it to end."""
        ...

    async def find_running(self) -> RunningAttempt | None:
        """The job's attempt that a supervisor lost before this one left running, if any;
        whatever such an attempt left that cannot be adopted is ended here."""
        ...

    async def adopt(self, running: RunningAttempt) -> AttemptOutcome:
        """Watch an attempt :meth:`find_running` found, as if this runner had started it,
        and wait for it to end."""
        ...

    def stop(self) -> None:
        """End the running attempt now (its ``run`` then returns)."""
        ...

    def failure_signalled(self) -> None:
        """A worker of the running attempt reported that its loop failed."""
        ...

    def leave(self, ranks: set[int]) -> set[int]:
        """In place only: these workers leave the running attempt (their nodes are
        draining) while the others train on. Returns those told."""
        ...

    def resize(self, size: int) -> set[int]:
        """In place only: the scheduler's new size for the running attempt (replicas beyond
        it leave at a step; below it, joiners are placed). Returns those told to leave."""
        ...

    def replica_trained(self, index: int) -> None:
        """In place only: replica ``index`` has committed a step (it is a survivor, no
        longer a joiner healing from a peer)."""
        ...

    def warm_workers(self, exclude: Collection[str] = ()) -> int:
        """Restart mode only: workers held between attempts (their slots are the job's own),
        leaving out those on ``exclude``."""
        ...

    async def warm_ahead(self, slots: list[Reservation]) -> int:
        """Restart mode only: place a worker in each of ``slots`` (one worker's reservation
        each, which its worker then holds) while the attempt trains and wait until they are
        ready, held between attempts; returns how many are."""
        ...

    def let_go(self) -> None:
        """Restart mode only: between attempts, the workers held go with their slots (the
        scheduler gave them to another job)."""
        ...

    def close(self) -> None:
        """The job ended, or is being cancelled: every worker goes, at once."""
        ...


def placement(resources_per_worker: dict[str, float]) -> dict[str, Any]:
    """The Ray actor options that give a worker of either mode its ``resources_per_worker``
    (Ray takes CPUs and GPUs apart from custom resources)."""
    resources = dict(resources_per_worker)
    return {
        "num_cpus": resources.pop("CPU", 1),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources or None,
    }
