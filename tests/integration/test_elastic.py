"""Elastic recovery on a real multi-node Ray cluster: nodes really die (their raylets are
killed) and come back, while jobs submitted over HTTP train on."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch

from elastic.job_state import TERMINAL_STATES
from elastic.restart.runner import SETTLE_S
from jobs import launcher
from tests.conftest import (
    NAMESPACE,
    ClusterPool,
    LiveServer,
    all_events,
    make_settings,
    state_address,
    wait_for,
    wait_until_ended,
    wait_until_the_scheduler_sees_the_pool,
)

DATASET = 1000
BATCH = 63  # splits unevenly over 2 workers: shares of 32 and 31


@pytest.fixture
def pool(ray_cluster: ClusterPool) -> Iterator[ClusterPool]:
    ray_cluster.restore_pool()
    # These tests count attempts from a start at 3 workers.
    wait_until_the_scheduler_sees_the_pool()
    yield ray_cluster
    ray_cluster.restore_pool()


@pytest.fixture
def api(pool: ClusterPool, tmp_path: Path) -> Iterator[httpx.Client]:
    # The test workloads (tests/workloads) may be submitted besides the built-in ones.
    with LiveServer(make_settings(tmp_path, entrypoint_modules=["tests.workloads"])) as live:
        yield live.client()


def elastic_job(
    max_steps: int,
    every: int = 10,
    min_workers: int = 1,
    grace_s: float = 300,
    fault_tolerance: str = "restart",
) -> dict[str, Any]:
    """The job these tests kill nodes under; restart mode unless said (in place has its
    own tests, tests/integration/test_in_place.py)."""
    return {
        "name": "elastic",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "synthetic_samples": DATASET,
            "max_steps": max_steps,
            "global_batch_size": BATCH,
            "learning_rate": 0.05,
            "seed": 7,
            "dtype": "float64",
            "record_samples": True,
            "lr_schedule": "cosine",
            "warmup_steps": 20,
        },
        "scaling": {"min_workers": min_workers, "max_workers": 3, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": every, "keep": 3},
        "failure": {"max_restarts": 3, "min_workers_grace_s": grace_s},
        "fault_tolerance": fault_tolerance,
    }


def get(api: httpx.Client, job_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def events(api: httpx.Client, job_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    """Every event of the job (of ``kind`` only), however many: a job's log lines are
    events too, and a first page alone could end before the late events a test looks for."""
    return all_events(api, job_id, kind)


def state_changes(api: httpx.Client, job_id: str) -> list[tuple[str, str | None]]:
    """Each state the job went through, with the reason it gave (what went wrong, when a
    job recovered that should not have)."""
    return [(e["data"]["state"], e["data"].get("reason")) for e in events(api, job_id, "state")]


def states(api: httpx.Client, job_id: str) -> list[str]:
    return [state for state, _ in state_changes(api, job_id)]


def assert_shrank_to_2_and_grew_back(
    api: httpx.Client, job_id: str, done: dict[str, Any], steps: int
) -> None:
    """A job that lost one of its 3 workers, went on at 2 and grew back to 3: all its steps,
    one recovery, and an attempt at each of those sizes."""
    assert done["state"] == "succeeded" and done["step"] == steps
    assert states(api, job_id) == [
        "queued",
        "starting",
        "running",
        "recovering",
        "running",
        "succeeded",
    ]
    assert [e["data"]["world_size"] for e in events(api, job_id, "attempt_started")] == [3, 2, 3]


def wait_until(api: httpx.Client, job_id: str, test: Any, timeout: float, what: str) -> dict:
    last: dict[str, Any] = {}

    def check() -> dict | None:
        job = last["job"] = get(api, job_id)
        assert job["state"] not in TERMINAL_STATES or test(job), job
        return job if test(job) else None

    try:
        return wait_for(check, timeout, interval=0.1, what=what)
    except AssertionError as e:  # where the job was when the wait gave up says why
        job = last.get("job", {})
        seen = {k: job.get(k) for k in ("state", "world_size", "step", "message")}
        raise AssertionError(f"{e}; the job: {seen}; its story: {story(api, job_id)}") from None


STORY = ("state", "attempt_started", "worker_lost", "resized", "restored", "scheduled")


def story(api: httpx.Client, job_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    """The job's events that tell what happened to it, without its metrics and logs."""
    return [(e["seq"], e["kind"], e["data"]) for e in events(api, job_id) if e["kind"] in STORY]


def final_state(api: httpx.Client, job_id: str, root: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's parameters and SGD momentum buffers, by name."""
    newest = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"][-1]
    # The API shows a checkpoint's path relative to the job's directory under the root.
    state = torch.load(root / job_id / newest["path"] / "state.pt", weights_only=True)
    tensors = dict(state["model"])
    (group,) = state["optimizer"]["param_groups"]
    # The small CNN has parameters only (no buffers): state_dict order is parameter order.
    for index, name in zip(group["params"], state["model"], strict=True):
        tensors[f"momentum:{name}"] = state["optimizer"]["state"][index]["momentum_buffer"]
    return tensors


def samples_that_count(checkpoint_root: Path) -> Counter[tuple[int, int]]:
    """(epoch, index) -> how often it went into the model: steps redone after a restore
    replace the ones the lost attempt had run."""
    by_step: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for f in (checkpoint_root / "samples").iterdir():
        for line in f.read_text().splitlines():
            r = json.loads(line)
            by_step.setdefault(r["s"], {}).setdefault(r["a"], []).extend(
                (r["e"], i) for i in r["i"]
            )
    counted: Counter[tuple[int, int]] = Counter()
    for attempts in by_step.values():
        counted.update(attempts[max(attempts)])
    return counted


def assert_every_sample_once(checkpoint_root: Path, steps: int) -> None:
    """Every sample of every epoch the job's ``steps`` covered went into the model exactly
    once: none twice, none left out."""
    counted = samples_that_count(checkpoint_root)
    assert set(counted.values()) == {1}
    # 15 steps of 63 and one of 55 make an epoch of 1000.
    assert len(counted) == steps * BATCH - (steps // 16) * (16 * BATCH - DATASET)
    for epoch in range(steps // 16):
        assert {i for e, i in counted if e == epoch} == set(range(DATASET)), epoch


def equivalence_job(steps: int) -> dict[str, Any]:
    spec = elastic_job(steps)
    # Augmentations seeded per sample: part of what must not change with the world size.
    spec["hyperparameters"]["augment"] = "crop_flip"
    return spec


def test_a_node_dies_and_comes_back_and_the_model_is_the_same(
    api: httpx.Client, pool: ClusterPool, tmp_path: Path
) -> None:
    """Float64, a batch of 63 (unequal shares at 2 and 3 workers; each epoch ends on a
    short batch of 55), augmentations on: a node dies between two checkpoints (steps are
    redone), comes back, and the final parameters and momentum buffers equal an
    uninterrupted run's to float64 rounding."""
    steps = 240
    baseline = api.post("/v1/jobs", json=equivalence_job(steps)).json()
    assert wait_until_ended(api, baseline["id"])["state"] == "succeeded"
    assert [e["data"]["world_size"] for e in events(api, baseline["id"], "attempt_started")] == [3]

    job = api.post("/v1/jobs", json=equivalence_job(steps)).json()
    wait_until(
        api,
        job["id"],
        # Midway between checkpoints (every 10 steps): the restart redoes steps.
        lambda j: j["step"] >= 40 and 3 <= j["step"] % 10 <= 6 and j["world_size"] == 3,
        180,
        "training at 3 workers, between two checkpoints",
    )
    pool.kill_node(pool.pool[1])
    wait_until(
        api,
        job["id"],
        lambda j: j["world_size"] == 2 and j["state"] == "running",
        120,
        "training at 2 workers",
    )
    # Some 60 steps at 2 before the node comes back. The job is not required to still be
    # at 2 then: the resizes asserted below are exactly one shrink and one grow whenever
    # the grow came (a run once reached its end without a poll seeing it at 2 past step
    # 100, and did not say why).
    wait_until(api, job["id"], lambda j: j["step"] >= 100, 120, "step 100")
    pool.add_node()
    done = wait_until_ended(api, job["id"])

    assert_shrank_to_2_and_grew_back(api, job["id"], done, steps)

    (lost,) = [e["data"] for e in events(api, job["id"], "worker_lost")]
    (restored,) = [e["data"] for e in events(api, job["id"], "restored")]
    shrink, grow = [e["data"] for e in events(api, job["id"], "resized")]
    assert lost["from_world"] == 3 and len(lost["nodes"]) == 1
    assert (shrink["from_world"], shrink["to_world"]) == (3, 2)
    assert restored == shrink | {"kind": "restored"}
    assert shrink["checkpoint_step"] % 10 == 0 and 0 < shrink["steps_redone"] <= 10
    # A few seconds from the kill on warm workers (stock Ray Train: ~70 s); the bound leaves
    # room for the 2 shared cores being busy and for the cold path (37 s seen under load).
    assert 0 < shrink["recovery_seconds"] < 45
    assert (grow["from_world"], grow["to_world"], grow["steps_redone"]) == (3 - 1, 3, 0)
    assert grow["checkpoint_step"] % 10 == 0

    assert_every_sample_once(tmp_path / "checkpoints" / job["id"], steps)

    # The proof that elasticity is invisible to the model.
    root = tmp_path / "checkpoints"
    ours = final_state(api, job["id"], root)
    reference = final_state(api, baseline["id"], root)
    assert ours.keys() == reference.keys()
    assert sum(name.startswith("momentum:") for name in reference) == 6
    for name, ref in reference.items():
        if not ref.is_floating_point():
            assert torch.equal(ours[name], ref), name
            continue
        rel = (ours[name] - ref).norm() / ref.norm()
        # float64 summation-order noise is ~1e-15; a float32 round-trip would be ~1e-7.
        assert rel <= 1e-10, (name, float(rel))


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(
    api: httpx.Client, pool: ClusterPool, tmp_path: Path
) -> None:
    job = api.post("/v1/jobs", json=elastic_job(400, every=50)).json()
    root = tmp_path / "checkpoints" / job["id"]
    wait_until(
        api, job["id"], lambda j: j["step"] >= 105 and j["world_size"] == 3, 180, "two checkpoints"
    )
    newest = sorted(root.glob("step_*"))[-1]
    (newest / "state.pt").write_bytes(b"\0" * (newest / "state.pt").stat().st_size)
    pool.kill_node(pool.pool[0])
    done = wait_until_ended(api, job["id"])

    assert done["state"] == "succeeded" and done["step"] == 400
    corrupt = [e["data"] for e in events(api, job["id"], "checkpoint_corrupt")]
    bad_step = int(newest.name.split("_")[1])
    assert [(c["step"], c["reason"]) for c in corrupt] == [
        (bad_step, f"{newest.name}: state.pt fails its checksum")
    ]
    (restored,) = [e["data"] for e in events(api, job["id"], "restored")]
    assert restored["checkpoint_step"] == bad_step - 50
    assert_every_sample_once(root, 400)


def test_below_min_workers_the_job_waits_then_fails(api: httpx.Client, pool: ClusterPool) -> None:
    job = api.post("/v1/jobs", json=elastic_job(100_000, min_workers=3, grace_s=3)).json()
    wait_until(api, job["id"], lambda j: j["state"] == "running", 180, "running")
    pool.kill_node(pool.pool[2])
    wait_until(api, job["id"], lambda j: j["state"] == "recovering", 30, "recovering")
    done = wait_until_ended(api, job["id"])
    assert done["state"] == "failed"
    assert done["message"] == (
        "only 2 workers of {'CPU': 1.0} fit, below min_workers (3), "
        "for longer than the 3 s grace period"
    )
    assert states(api, job["id"]) == ["queued", "starting", "running", "recovering", "failed"]
    assert [e["data"]["from_world"] for e in events(api, job["id"], "worker_lost")] == [3]


def test_a_job_waits_queued_while_even_min_workers_do_not_fit(
    api: httpx.Client, pool: ClusterPool
) -> None:
    hog = api.post("/v1/jobs", json=elastic_job(100_000, min_workers=3)).json()
    wait_until(api, hog["id"], lambda j: j["state"] == "running", 180, "the first job running")
    waiting = api.post("/v1/jobs", json=elastic_job(100_000, min_workers=2)).json()
    for _ in range(10):
        assert get(api, waiting["id"])["state"] == "queued"
        time.sleep(0.3)
    assert api.post(f"/v1/jobs/{hog['id']}/cancel").json()["state"] == "cancelled"
    started = wait_until(
        api, waiting["id"], lambda j: j["state"] == "running", 180, "the second job running"
    )
    assert started["world_size"] == 3  # all of the cluster, once it is free
    api.post(f"/v1/jobs/{waiting['id']}/cancel")
    assert states(api, waiting["id"]) == ["queued", "starting", "running", "cancelled"]


def test_a_job_that_keeps_failing_stops_after_max_restarts(
    api: httpx.Client, pool: ClusterPool, tmp_path: Path
) -> None:
    spec = elastic_job(100)
    spec["hyperparameters"] |= {"dataset": "imagefolder", "data_path": str(tmp_path / "nope")}
    spec["failure"]["max_restarts"] = 1
    job = api.post("/v1/jobs", json=spec).json()
    done = wait_until_ended(api, job["id"])
    assert done["state"] == "failed" and done["restarts"] == 1
    # Every rank fails the same way; whichever reports first names itself.
    assert re.match(r"rank [0-2]: FileNotFoundError: ", done["message"])
    assert str(tmp_path / "nope") in done["message"]
    assert done["message"].endswith("(gave up after 1 restart; max_restarts is 1)")
    assert states(api, job["id"]) == ["queued", "starting", "recovering", "failed"]


def test_a_job_whose_supervisor_dies_goes_on_from_its_checkpoint(
    api: httpx.Client, pool: ClusterPool, tmp_path: Path
) -> None:
    steps = 120
    job = api.post("/v1/jobs", json=elastic_job(steps)).json()
    wait_until(api, job["id"], lambda j: j["step"] >= 25, 180, "two checkpoints")
    supervisor = ray.get_actor(launcher.supervisor_name(job["id"]), namespace=NAMESPACE)
    ray.kill(supervisor, no_restart=True)  # its attempt (owned by it) dies with it
    done = wait_until_ended(api, job["id"])

    assert done["state"] == "succeeded" and done["step"] == steps
    (note,) = [e["data"] for e in events(api, job["id"], "supervisor_recreated")]
    assert note["previous_state"] == "running" and note["checkpoint_step"] >= 20
    assert states(api, job["id"]) == [
        "queued",
        "starting",
        "running",
        "recovering",
        "running",
        "succeeded",
    ]
    (restored,) = [e["data"] for e in events(api, job["id"], "restored")]
    assert restored["checkpoint_step"] == note["checkpoint_step"]
    assert_every_sample_once(tmp_path / "checkpoints" / job["id"], steps)


# Kill to the first step at the new size: bench/recovery.py's median on the 2-core machine
# was 23.7 s (22.0-24.4) with a Ray Train worker group per attempt, and is 2.3 s (2.2-7.5)
# on warm workers (elastic/restart/); a full-suite run here once took 49 s with the old
# path (the machine loaded with the processes earlier tests leave). The bound leaves room
# for a loaded machine and for the cold path (survivors killed, new workers placed).
RECOVERY_BOUND_S = 60


@pytest.mark.alone  # it compares the recovery's start with the kill's time
def test_a_node_loss_is_timed_from_the_failure(api: httpx.Client, pool: ClusterPool) -> None:
    job = api.post("/v1/jobs", json=elastic_job(100_000)).json()
    wait_until(api, job["id"], lambda j: j["step"] >= 15 and j["world_size"] == 3, 180, "3 workers")
    killed_at = time.time()
    pool.kill_node(pool.pool[1])
    wait_until(api, job["id"], lambda j: j["world_size"] == 2 and j["state"] == "running", 120, "2")
    (shrink,) = [e["data"] for e in events(api, job["id"], "resized")]
    first = min(
        at
        for e in events(api, job["id"], "metrics")
        if e["data"]["world_size"] == 2
        and (at := datetime.fromisoformat(e["time"]).timestamp()) > killed_at
    )
    measured = first - killed_at
    api.post(f"/v1/jobs/{job['id']}/cancel")

    assert 0 < shrink["recovery_seconds"] < RECOVERY_BOUND_S
    # Timed from the first failure signal, a step at most after the kill (the survivors'
    # collectives fail at once), not from Ray's membership, which lags 3 s (three missed
    # 1 s health checks): a recovery timed from that would be 3 s short of the measured.
    assert measured - 1.5 <= shrink["recovery_seconds"] <= measured + 0.5, (measured, shrink)
    # The attempt ended on that signal, a survivor's failed collective, and not on Ray's
    # word that the node left: that reason would say "node ... left the cluster". The
    # dead worker is the one whose ping goes unanswered; the attempt ends when the
    # survivors' runs are back too (0.6-1.0 s seen alone, 3.0 s once in CI, where Ray's
    # workers run at niceness 15 beside the suite's own processes), and never later than
    # SETTLE_S, when the runs still going are killed. 0 would be an end before the signal,
    # hidden by the clamp.
    (lost,) = [e["data"] for e in events(api, job["id"], "worker_lost")]
    assert lost["from_world"] == 3 and len(lost["nodes"]) == 1
    assert lost["reason"].startswith("rank "), lost
    assert 0 < shrink["detection_seconds"] < SETTLE_S, shrink


def warm_workers() -> dict[str, tuple[int, str]]:
    """The restart-mode workers alive on the cluster: actor id -> (pid, node id)."""
    from ray.util.state import list_actors

    return {
        a.actor_id: (a.pid, a.node_id)
        for a in list_actors(
            address=state_address(),
            filters=[("class_name", "=", "WarmWorker"), ("state", "=", "ALIVE")],
        )
    }


@pytest.mark.alone  # it bounds the pause from the kill to the first step at 2
def test_a_restart_after_a_node_loss_trains_on_the_survivors_processes(
    api: httpx.Client, pool: ClusterPool, tmp_path: Path
) -> None:
    """Restart mode keeps its workers between attempts: after a node's loss the next attempt
    (2 workers, from the newest checkpoint) runs in the surviving processes (both, but for a
    known outlier), not in new ones; the node added back brings one new worker beside them.
    Every sample once."""
    # Long enough to outlast, after the kill, a node's start and its new worker's warm-up
    # (it is placed and imports torch while the others train, before the grow's pause):
    # 160 steps once ended at 2 workers on a loaded machine.
    steps = 320
    job = api.post("/v1/jobs", json=elastic_job(steps)).json()
    wait_until(api, job["id"], lambda j: j["step"] >= 25 and j["world_size"] == 3, 180, "3 workers")
    before = warm_workers()
    assert len(before) == 3
    victim = pool.pool[1]
    (killed,) = [a for a, (_, node) in before.items() if node == victim.node_id]
    killed_at = time.time()
    pool.kill_node(victim)
    wait_until(
        api, job["id"], lambda j: j["world_size"] == 2 and j["state"] == "running", 60, "2 workers"
    )
    first_at_2 = min(
        at
        for e in events(api, job["id"], "metrics")
        if e["data"]["world_size"] == 2
        and (at := datetime.fromisoformat(e["time"]).timestamp()) > killed_at
    )
    # The same two actors and processes as before the loss: no worker process was started.
    # (Ray may list the dead node's actor as alive for seconds: its node is left out.)
    survivors = {a: w for a, w in warm_workers().items() if w[1] != victim.node_id}
    kept = {a: w for a, w in before.items() if a != killed}
    # Usually both (about 2 s to the first step at 2). The known outlier (README, Measured
    # here, 8-10 s): a survivor whose collective stays blocked past the settle bounds is
    # killed and replaced by a new worker; the other is still reused. Never neither.
    reused = {a: w for a, w in survivors.items() if kept.get(a) == w}
    assert len(reused) >= 1 and len(survivors) == 2, (survivors, kept, first_at_2 - killed_at)
    pool.add_node()
    done = wait_until_ended(api, job["id"])

    assert_shrank_to_2_and_grew_back(api, job["id"], done, steps)
    (lost,) = [e["data"] for e in events(api, job["id"], "worker_lost")]
    assert lost["nodes"] == [victim.node_id] and lost["from_world"] == 3
    shrink, grow = [e["data"] for e in events(api, job["id"], "resized")]
    assert (shrink["from_world"], shrink["to_world"]) == (3, 2)
    assert (grow["from_world"], grow["to_world"], grow["steps_redone"]) == (2, 3, 0)
    # The grow's pause, from its checkpoint to the first step at 3: the new worker was
    # placed and warmed while the others trained (0.3-0.7 s measured, docs/benchmarks.md).
    # A worker placed in the pause imports torch there (2.6-3.8 s before): the bound
    # catches that.
    assert grow["recovery_seconds"] < 2.0, grow
    # The goal is 10 s from the kill to the first step at 2 on this 2-core machine; the
    # bound leaves room for a loaded machine, not for a worker group started anew (~24 s).
    assert first_at_2 - killed_at < 15, first_at_2 - killed_at
    assert_every_sample_once(tmp_path / "checkpoints" / job["id"], steps)
