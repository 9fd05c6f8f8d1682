"""The service's calls to the cluster's scheduler (``elastic/cluster/capacity.py``'s shared watcher,
one detached actor per namespace): the owners' quotas it schedules within, and its view of
the queue for ``GET /v1/queue``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import ray

from elastic.cluster.capacity import RowDecision, shared_watcher
from elastic.cluster.scheduling import Demand
from elastic.cluster.scheduling import Knobs as Knobs  # the service builds them: re-exported
from jobs.spec import JobSpec

# The scheduler answers from memory: longer than this means it is not running (its node is
# being declared dead, or it is being re-created), and the caller says so rather than hang.
CALL_TIMEOUT_S = 10.0

Quotas = Mapping[str, Mapping[str, float | None]]


# The scheduler's handle per namespace and cluster connection: looking it up places it on the
# head node, a GCS read of every node, which was most of a read of ``GET /v1/queue``.
_watchers: dict[tuple[str, object], Any] = {}


async def _watcher(namespace: str, fresh: bool) -> Any:
    from ray._private.worker import global_worker

    key = (namespace, global_worker.current_cluster_and_job)
    if fresh or key not in _watchers:
        # Looking the actor up (or starting it) is a GCS call: off the event loop.
        _watchers[key] = await asyncio.to_thread(shared_watcher, namespace)
    return _watchers[key]


async def _call(namespace: str, method: str, *args: Any, timeout_s: float) -> Any:
    """One call to the scheduler; if it died (killed, its node lost), ``shared_watcher``
    starts a new one, which is called once more."""
    for tries_left in (1, 0):
        watcher = await _watcher(namespace, fresh=not tries_left)
        try:
            return await asyncio.wait_for(getattr(watcher, method).remote(*args), timeout_s)
        except ray.exceptions.RayActorError:
            if not tries_left:
                raise
    raise AssertionError("unreachable")


async def push_quotas(
    namespace: str,
    quotas: Quotas,
    knobs: Knobs | None = None,
    timeout_s: float = CALL_TIMEOUT_S,
) -> None:
    """Replace the scheduler's quotas: owner -> {"workers": n or None, "gpus": n or None},
    the default under "*" (what an owner not named gets); and its knobs, when given."""
    body = {owner: dict(quota) for owner, quota in quotas.items()}
    await _call(namespace, "set_quotas", body, knobs, timeout_s=timeout_s)


async def keep_warm(namespace: str, per_node: int, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Have the scheduler keep ``per_node`` processes ready to train on each node
    (``elastic/warm_processes.py``)."""
    await _call(namespace, "keep_warm", per_node, timeout_s=timeout_s)


async def queue_view(
    namespace: str,
    after_position: int = 0,
    limit: int | None = None,
    timeout_s: float = CALL_TIMEOUT_S,
) -> dict[str, Any]:
    """The scheduler's ``queue()``: ``{"queue": [...], "waiting": n, "running": [...],
    "quotas": {...}}``, the waiting entries after ``after_position``, at most ``limit`` (its
    docstring has the fields)."""
    view: dict[str, Any] = await _call(
        namespace, "queue", after_position, limit, timeout_s=timeout_s
    )
    return view


def demand(job_id: str, spec: JobSpec, owner: str, submitted_at: float) -> Demand:
    """What the job asks of the scheduler: the same whether its row or its supervisor asks
    (``jobs.launcher.launch`` gives the supervisor these values)."""
    return Demand(
        job_id=job_id,
        owner=owner,
        priority=spec.priority_value,
        min_workers=spec.scaling.min_workers,
        max_workers=spec.scaling.max_workers,
        per_worker=dict(spec.scaling.worker_resources()),
        submitted_at=submitted_at,
        resize=spec.recovery_mode,
    )


async def hold_rows(
    namespace: str, demands: list[Demand], timeout_s: float = CALL_TIMEOUT_S
) -> tuple[int, dict[str, RowDecision]]:
    """Book the queued jobs that have no supervisor (all of them: a job left out is
    unbooked); the books' version and each one's decision (``MembershipWatcher.hold_rows``)."""
    answer: tuple[int, dict[str, RowDecision]] = await _call(
        namespace, "hold_rows", demands, timeout_s=timeout_s
    )
    return answer


async def news_after(namespace: str, after_version: int, wait_s: float) -> int:
    """Once the scheduler's books change after ``after_version``, or ``wait_s`` has passed:
    the version then."""
    version: int = await _call(
        namespace, "news_after", after_version, wait_s, timeout_s=wait_s + CALL_TIMEOUT_S
    )
    return version


async def forget(namespace: str, job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """The job ended and the service stops its supervisor: the scheduler plans without it
    from now on. A supervisor takes itself off the book as its loop ends, but the service
    stops it as soon as it has stored the end, which can come first; the scheduler then found
    it gone only at its next check (``elastic.cluster.capacity.SCHEDULER_CHECK_S``), and a job
    submitted meanwhile was planned beside it: seen starting at 1 worker of 3 free."""
    await _call(namespace, "unregister", job_id, timeout_s=timeout_s)
