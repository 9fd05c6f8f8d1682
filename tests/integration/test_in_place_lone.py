"""In place, a job of one replica: a silence past the lighthouse's heartbeat timeout frees
no survivor, so it is not taken for a loss (on a loaded machine it is more likely the
machine than the job); a replica frozen for good is fenced after the long timeout
(elastic/in_place/watchdog.py) and the job restarts from its checkpoint.

Not ``alone``: its bounds hold on a shared machine (the rule does not depend on timing,
and the long timeout's bound has seconds of slack)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest

from elastic.in_place.watchdog import ALONE_TIMEOUT_S
from tests.conftest import ClusterPool, wait_for, wait_until_ended
from tests.integration.test_elastic import (  # noqa: F401
    api,
    events,
    pool,
    state_changes,
    wait_until,
)
from tests.integration.test_elastic import get as get_job
from tests.integration.test_in_place import in_place_job, replica_pids, stopped

pytestmark = [pytest.mark.ray]


def test_a_lone_replica_stalled_for_a_moment_trains_on_and_one_frozen_for_good_is_restarted(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
) -> None:
    """A job of one replica: a silence past the heartbeat timeout (a stopped process, as a
    starved one looks) frees no survivor, so it is no loss; the same replica stopped for
    good is fenced after the long timeout and the job restarts from its checkpoint."""
    steps = 400
    spec = in_place_job(steps)
    spec["scaling"] |= {"min_workers": 1, "max_workers": 1}
    job = api.post("/v1/jobs", json=spec).json()
    assert "id" in job, job
    wait_until(
        api, job["id"], lambda j: j["state"] == "running" and j["step"] >= 10, 120, "training"
    )
    (lone,) = replica_pids()
    os.kill(lone, signal.SIGSTOP)
    time.sleep(1.5)  # five heartbeat timeouts
    os.kill(lone, signal.SIGCONT)
    resumed = get_job(api, job["id"])["step"]
    wait_until(api, job["id"], lambda j: j["step"] >= resumed + 10, 60, "training on after it")
    assert replica_pids() == [lone]
    assert events(api, job["id"], "worker_lost") == []
    assert len(events(api, job["id"], "attempt_started")) == 1

    os.kill(lone, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        wait_for(lambda: stopped(lone), 5, interval=0.01, what="the replica stopped")
        wait_for(lambda: not stopped(lone), 30, interval=0.1, what="the frozen replica fenced")
        fenced_after = time.monotonic() - frozen
    finally:
        if stopped(lone):
            with contextlib.suppress(ProcessLookupError):
                os.kill(lone, signal.SIGKILL)
    assert ALONE_TIMEOUT_S - 0.1 <= fenced_after < ALONE_TIMEOUT_S + 5, fenced_after
    done = wait_until_ended(api, job["id"])
    assert (done["state"], done["step"]) == ("succeeded", steps), done
    assert state_changes(api, job["id"]) == [
        ("queued", None),
        ("starting", None),
        ("running", None),
        ("recovering", "every replica was lost"),
        ("running", None),
        ("succeeded", None),
    ]
    assert len(events(api, job["id"], "attempt_started")) == 2
