"""The service's calls to the cluster's scheduler (``elastic/cluster/capacity.py``'s shared watcher,
one detached actor per namespace): the owners' quotas it schedules within, and its view of
the queue for ``GET /v1/queue``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import ray

from elastic.cluster.capacity import shared_watcher
from elastic.cluster.scheduling import Knobs as Knobs  # the service builds them: re-exported

# The scheduler answers from memory: longer than this means it is not running (its node is
# being declared dead, or it is being re-created), and the caller says so rather than hang.
CALL_TIMEOUT_S = 10.0

Quotas = Mapping[str, Mapping[str, float | None]]


async def _call(namespace: str, method: str, *args: Any, timeout_s: float) -> Any:
    """One call to the scheduler; if it died (killed, its node lost), ``shared_watcher``
    starts a new one, which is called once more."""
    for tries_left in (1, 0):
        # Looking the actor up (or starting it) is a GCS call: off the event loop.
        watcher = await asyncio.to_thread(shared_watcher, namespace)
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


async def queue_view(namespace: str, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """The scheduler's ``queue()``: ``{"queue": [...], "running": [...], "quotas": {...}}``
    (its docstring has the fields)."""
    view: dict[str, Any] = await _call(namespace, "queue", timeout_s=timeout_s)
    return view


async def forget(namespace: str, job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """The job ended and the service stops its supervisor: the scheduler plans without it
    from now on. A supervisor takes itself off the book as its loop ends, but the service
    stops it as soon as it has stored the end, which can come first; the scheduler then found
    it gone only at its next check (``elastic.cluster.capacity.SCHEDULER_CHECK_S``), and a job
    submitted meanwhile was planned beside it: seen starting at 1 worker of 3 free."""
    await _call(namespace, "unregister", job_id, timeout_s=timeout_s)
