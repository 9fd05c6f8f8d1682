"""Head-node fault tolerance (GCS FT) against a real Redis: a Ray head started with its GCS
state in Redis (`RAY_REDIS_ADDRESS`, as KubeRay's gcsFaultToleranceOptions sets it), the
GCS process SIGKILLed mid-job and started again with its own command line and environment
(what restarting the head's GCS does), and the service's job still ends `succeeded` with
every step counted once.

Needs a Redis on 127.0.0.1:6379 (the development and CI machines run one); skipped, saying
so, where there is none. The head uses a Redis namespace of its own, deleted at the end."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic.job_state import TERMINAL_STATES
from tests.conftest import all_events, free_port, small_job, wait_for
from tests.gcs import (
    NO_REDIS,
    end_sessions,
    fault_tolerant_env,
    forget,
    kill_gcs,
    program_in,
    redis,
    redis_answers,
)
from tests.ray_head import clean_env, head_command, serve_env, served


@dataclass
class Head:
    address: str
    namespace: str
    sessions: list[int]

    def gcs_pid(self) -> int | None:
        return program_in(self.sessions, "gcs_server")


@pytest.fixture(scope="module")
def redis_head() -> Iterator[Head]:
    """A Ray head (not blocking: `ray start --block` kills the whole head when one of its
    processes dies) whose GCS keeps its state in Redis."""
    if not redis_answers():
        pytest.skip(NO_REDIS)
    namespace = f"etrain-gcsft-{uuid.uuid4().hex[:12]}"
    port = free_port()
    temp = tempfile.mkdtemp(prefix="egcs-", dir="/tmp")  # Ray's socket paths must be short
    env = (
        clean_env()
        | fault_tolerant_env(namespace)
        | {
            # `ray start` turns token auth on by itself when ~/.ray/auth_token exists (any
            # earlier `ray get-auth-token --generate` leaves one); this head is about GCS FT.
            "RAY_AUTH_MODE": "disabled",
        }
    )
    start = subprocess.Popen(
        head_command(port, temp, block=False),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    head = Head(f"127.0.0.1:{port}", namespace, [start.pid])
    try:
        assert start.wait(timeout=180) == 0, "ray start --head failed"
        yield head
    finally:
        end_sessions(head.sessions)
        shutil.rmtree(temp, ignore_errors=True)
        forget(namespace)


def test_a_job_survives_a_restart_of_the_heads_gcs(redis_head: Head, tmp_path: Path) -> None:
    env = serve_env(tmp_path, redis_head.address, free_port())
    with served(env, tmp_path / "serve.log") as api:
        job_id = api.post("/v1/jobs", json=small_job(max_steps=200)).json()["id"]
        wait_for(
            lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["step"] >= 20 and j,
            timeout=180,
            what="the job to train a while",
        )
        # The GCS's state is in Redis, under this head's namespace.
        keys = redis("KEYS", f"*{redis_head.namespace}*")
        assert keys.startswith(b"*") and keys != b"*0\r\n", keys
        (head_node,) = [n["node_id"] for n in api.get("/v1/cluster").json()["nodes"]]
        start_gcs = kill_gcs(redis_head.sessions)
        at_kill = api.get(f"/v1/jobs/{job_id}").json()
        assert at_kill["state"] == "running" and at_kill["step"] < 150, at_kill
        # With no GCS, the job trains on and the service still collects its steps (they
        # go from the workers to the supervisor to the service, none through the GCS).
        wait_for(
            lambda: api.get(f"/v1/jobs/{job_id}").json()["step"] >= at_kill["step"] + 10,
            timeout=40,
            what="the job to train on while the GCS is down",
        )
        new_gcs = start_gcs()
        job = wait_for(
            lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["state"] in TERMINAL_STATES and j,
            timeout=300,
            interval=1,
            what="the job to end after the GCS restart",
        )
        assert (job["state"], job["step"]) == ("succeeded", 200), job
        # The restarted GCS serves the cluster: it knows the head's raylet, which lived on.
        assert redis_head.gcs_pid() == new_gcs
        nodes = api.get("/v1/cluster").json()["nodes"]
        assert [(n["node_id"], n["alive"], n["total"]["CPU"]) for n in nodes] == [
            (head_node, True, 2.0)
        ]
        # The job never noticed: one supervisor, one attempt, no restore, every step once.
        events = all_events(api, job_id)
        kinds = [e["kind"] for e in events]
        states = [e["data"]["state"] for e in events if e["kind"] == "state"]
        assert states == ["queued", "starting", "running", "succeeded"], states
        assert kinds.count("attempt_started") == 1, kinds
        assert not {"restored", "supervisor_recreated", "resized"} & set(kinds), kinds
        steps = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
        assert steps == list(range(1, 201)), steps
