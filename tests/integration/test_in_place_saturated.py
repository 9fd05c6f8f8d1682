"""In-place detection must not cry wolf: with every core saturated by other processes, a
healthy in-place job keeps all its replicas (no loss, no resize, no restart).

The suite runs it for SATURATED_S seconds (30 by default); the issue's 10-minute run is the
same test with ``ETRAIN_TEST_SATURATED_S=600`` (its result is in docs/recovery.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ClusterPool, wait_until_ended
from tests.integration.test_elastic import api, events, get, pool, wait_until  # noqa: F401
from tests.integration.test_in_place import in_place_job

pytestmark = [pytest.mark.ray, pytest.mark.alone]

SATURATED_S = float(os.environ.get("ETRAIN_TEST_SATURATED_S", "30"))
# Two spinning processes per core: each replica (and Ray, and the lighthouse, and the
# supervisor's watch) gets well under a core, as on a node shared with a data loader or
# another tenant's job.
SPINNERS_PER_CORE = 2
CHANGES = ("worker_lost", "joined", "resized", "attempt_started")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Spinners:
    """Processes that do nothing but spin, SPINNERS_PER_CORE per core, until stopped."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(SPINNERS_PER_CORE * (os.cpu_count() or 1))
        ]

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def spinners() -> Iterator[Spinners]:
    s = Spinners()
    try:
        yield s
    finally:
        s.stop()


def test_a_saturated_cpu_raises_no_false_alarm(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    spinners: Spinners,
) -> None:
    spec = in_place_job(10_000_000)
    spec["hyperparameters"]["record_samples"] = False
    job = api.post("/v1/jobs", json=spec).json()
    assert "id" in job, job
    start = wait_until(
        api,
        job["id"],
        lambda j: j["world_size"] == 3 and j["state"] == "running" and j["step"] >= 5,
        300,
        "training at 3 replicas",
    )
    # The replicas that came up after the first joined its quorum (each a joined and a
    # resized event); from here on, nothing may change.
    changes_before = len(events(api, job["id"], "resized"))
    # Saturated once training: what is tested is detection while the replicas train.
    spinners.start()
    began = time.monotonic()
    while time.monotonic() - began < SATURATED_S:
        now = get(api, job["id"])
        changes = [e["data"] for e in events(api, job["id"]) if e["kind"] in CHANGES]
        assert (now["state"], now["world_size"]) == ("running", 3), (now, changes)
        time.sleep(1)
    end = get(api, job["id"])
    spun = spinners.cpu_seconds()
    spinners.stop()
    api.post(f"/v1/jobs/{job['id']}/cancel")
    done = wait_until_ended(api, job["id"], 120)
    print(
        f"saturated {SATURATED_S:.0f} s: steps {start['step']} -> {end['step']}, "
        f"spinners used {spun:.0f} CPU-s of {SATURATED_S * (os.cpu_count() or 1):.0f}"
    )
    # The machine really was saturated: the spinners took at least half of every core.
    assert spun >= 0.5 * SATURATED_S * (os.cpu_count() or 1)
    # Training went on, slowly, and nobody was dropped, fenced, or restarted.
    assert end["step"] > start["step"]
    assert done["state"] == "cancelled"
    assert events(api, job["id"], "worker_lost") == []
    assert len(events(api, job["id"], "resized")) == changes_before
    assert len(events(api, job["id"], "attempt_started")) == 1
