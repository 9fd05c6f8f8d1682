"""In-place recovery on a real multi-node Ray cluster: a node dies under a job in
``fault_tolerance: in_place`` mode, the survivors train on from the same step without a
restart, and a node added back joins, healed from a peer."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch

from elastic.in_place.fence import process_of
from elastic.in_place.replica import RENDEZVOUS_TIMEOUT
from jobs import launcher
from tests.conftest import (
    NAMESPACE,
    ClusterPool,
    MachineShare,
    longest_pause_after,
    wait_for,
    wait_until_ended,
)
from tests.integration.test_elastic import (  # noqa: F401  (fixtures)
    BATCH,
    DATASET,
    api,
    elastic_job,
    events,
    final_state,
    pool,
    wait_until,
)
from tests.workloads.held_heal import parameters_digest

pytestmark = [pytest.mark.ray, pytest.mark.alone]

# The survivors' longest pause around a loss. A peer whose sockets reset (its process
# died; a replica ends within 50 ms of its raylet, elastic/train/orphan.py) fails their
# all-reduce at once: well under a second. A peer that stops without resetting them
# (frozen) is detected by the lighthouse's heartbeat timeout (0.3 s, plus up to one 50 ms
# heartbeat interval), the supervisor's poll of it (0.1 s) and the abort; the pause also
# holds the part of the step in flight before the loss and the redone step (0.2-0.3 s each
# at 3 replicas on this shared 2-core machine): hence 1.5 s and not 1 s.
LOSS_PAUSE_BOUND_S = 1.5
JOIN_PAUSE_BOUND_S = 1.0
# Two nodes lost: a member of the survivors' next quorum may be one that is dying, which that
# quorum's process group gives up after elastic.in_place.replica.RENDEZVOUS_TIMEOUT.
TWO_LOSSES_PAUSE_BOUND_S = LOSS_PAUSE_BOUND_S + RENDEZVOUS_TIMEOUT.total_seconds()


def in_place_job(steps: int) -> dict[str, Any]:
    spec = elastic_job(steps, every=20, fault_tolerance="in_place")
    spec["hyperparameters"]["augment"] = "crop_flip"
    return spec


def committed_samples(job_root: Path) -> Counter[tuple[int, int]]:
    """(epoch, index) -> how often a committed step trained on it. Every committing replica
    writes the step's whole batch: they must agree, and each step counts once."""
    by_step: dict[int, tuple[int, list[int]]] = {}
    for f in (job_root / "samples").iterdir():
        for line in f.read_text().splitlines():
            r = json.loads(line)
            seen = by_step.setdefault(r["s"], (r["e"], r["i"]))
            assert seen == (r["e"], r["i"]), f"replicas disagree on step {r['s']}"
    counted: Counter[tuple[int, int]] = Counter()
    for epoch, indices in by_step.values():
        counted.update((epoch, i) for i in indices)
    return counted


def replica_pids() -> list[int]:
    """This machine's in-place replica processes (Ray titles them after the actor's task)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    # Titled after its latest task: ``run``, or ``result`` once watched.
                    if f.read().startswith(b"ray::Replica."):
                        pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


# Long enough that after a node's loss and its return (a new replica imports torch and
# heals in while the others train), a test still has steps left to stop a replica in:
# 240 once ended first on a loaded machine.
STEPS = 320
# The uninterrupted run's final parameters and momentum, made once for the module's tests.
_reference: dict[str, torch.Tensor] = {}


def reference_state(client: httpx.Client, root: Path) -> dict[str, torch.Tensor]:
    """The same job uninterrupted, in restart mode (classic DDP): what every in-place run
    with losses and joins must end with."""
    if not _reference:
        spec = in_place_job(STEPS)
        spec["fault_tolerance"] = "restart"
        reference = client.post("/v1/jobs", json=spec).json()
        assert wait_until_ended(client, reference["id"])["state"] == "succeeded"
        _reference.update(final_state(client, reference["id"], root))
    return _reference


def assert_exact(client: httpx.Client, job_id: str, root: Path) -> None:
    """Every sample of every epoch went into the model exactly once, and in float64 the
    parameters and momentum buffers equal the uninterrupted run's."""
    counted = committed_samples(root / job_id)
    assert set(counted.values()) == {1}
    for epoch in range(STEPS // 16):
        assert {i for e, i in counted if e == epoch} == set(range(DATASET))
    assert len(counted) == STEPS * BATCH - (STEPS // 16) * (16 * BATCH - DATASET)
    ours, theirs = final_state(client, job_id, root), reference_state(client, root)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert tensor.dtype == torch.float64
        torch.testing.assert_close(ours[name], tensor, rtol=1e-10, atol=1e-12, msg=name)


def succeeded_without_restart(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """Waits for the job's end: it succeeded at its last step in its first attempt (the
    survivors never left it). Returns its losses' events."""
    done = wait_until_ended(client, job_id)
    assert done["state"] == "succeeded" and done["step"] == STEPS, done
    assert len(events(client, job_id, "attempt_started")) == 1  # no restart
    return [e["data"] for e in events(client, job_id, "worker_lost")]


def start_at_three_replicas(
    client: httpx.Client, root: Path, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The uninterrupted reference made (once), then the in-place job (``spec``, or
    ``in_place_job(STEPS)``) submitted and training at 3 replicas past its first steps."""
    reference_state(client, root)
    job: dict[str, Any] = client.post("/v1/jobs", json=spec or in_place_job(STEPS)).json()
    assert "id" in job, job
    wait_until(
        client,
        job["id"],
        lambda j: j["world_size"] == 3 and j["state"] == "running" and j["step"] >= 15,
        240,
        "training at 3 replicas",
    )
    return job


def test_a_node_dies_the_survivors_train_on_and_a_returning_node_joins_in_place(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    tmp_path: Path,
) -> None:
    steps = STEPS
    job = start_at_three_replicas(api, tmp_path / "checkpoints")
    pool.kill_node(pool.pool[1])
    wait_until(api, job["id"], lambda j: j["world_size"] == 2 and j["step"] >= 40, 60, "2 replicas")
    pool.add_node()
    wait_until(api, job["id"], lambda j: j["world_size"] == 3 and j["step"] >= 80, 120, "back")
    # A hung replica (a stopped process: its sockets stay open, so a peer's all-reduce would
    # wait out the collective timeout): fenced, and its replacement joins on the freed slot.
    (hung, *_) = replica_pids()
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_until(api, job["id"], lambda j: j["world_size"] == 2, 30, "the hung replica dropped")
        # The supervisor killed the hung process (a stopped process dies of SIGKILL only).
        wait_until(api, job["id"], lambda j: not stopped(hung), 30, "the hung replica killed")
        wait_until(api, job["id"], lambda j: j["world_size"] == 3, 120, "its replacement joined")
        done = wait_until_ended(api, job["id"])
    finally:
        if stopped(hung):
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
    assert done["state"] == "succeeded" and done["step"] == steps, done

    # No restart: one attempt, the survivors never left it.
    assert len(events(api, job["id"], "attempt_started")) == 1
    lost_events = events(api, job["id"], "worker_lost")
    losses = [e["data"] for e in lost_events]
    print("in place, node loss then hung replica:", losses)
    assert [(x["from_world"], x["to_world"]) for x in losses] == [(3, 2), (3, 2)]
    # The killed node's peer: its sockets reset and the survivors' all-reduce fails at once,
    # or, when its process lingers, the lighthouse drops it and the supervisor aborts the
    # survivors' step. The hung replica: dropped, its step aborted, its process killed
    # (without that Ray counts a stopped process alive: no replacement, and the wait above
    # for one fails).
    assert all(x["pause_seconds"] < LOSS_PAUSE_BOUND_S for x in losses), losses
    # At the start the first replica up forms the quorum alone and the others join it as
    # they come up; after each loss, one replica joins: the node added back, then the hung
    # replica's replacement.
    first_loss = lost_events[0]["seq"]
    joined = [e["data"] for e in events(api, job["id"], "joined") if e["seq"] > first_loss]
    print("in place, joins:", joined)
    assert [(j["from_world"], j["to_world"], j["steps_redone"]) for j in joined] == [(2, 3, 0)] * 2
    assert all(j["pause_seconds"] < JOIN_PAUSE_BOUND_S for j in joined), joined
    # Every step is reported, and every report says how fast the job trained since the one
    # before. A quorum's rank 0 lost right after a commit takes that step's report with it:
    # only the last step before a loss may be missing.
    reports = [e["data"] for e in events(api, job["id"], "metrics")]
    missing = set(range(1, steps + 1)) - {r["step"] for r in reports}
    assert missing <= {x["step"] - 1 for x in losses}, (missing, losses)
    rates = [r["samples_per_s"] for r in reports]
    assert all(r is not None and r > 0 for r in rates), rates[:5]

    assert_exact(api, job["id"], tmp_path / "checkpoints")


def test_two_nodes_killed_at_once_leave_one_replica_training_and_both_rejoin(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two nodes fail at the same instant: the last replica trains on alone, from the same
    step, and the two nodes added back join it. (Nodes lost a moment apart: the next test.)"""
    root = tmp_path / "checkpoints"
    job = start_at_three_replicas(api, root)
    pool.kill_nodes_at_once([pool.pool[0], pool.pool[1]])
    at_one = wait_until(api, job["id"], lambda j: j["world_size"] == 1, 60, "1 replica")
    wait_until(api, job["id"], lambda j: j["step"] >= at_one["step"] + 10, 60, "training alone")
    pool.add_node()
    pool.add_node()
    wait_until(api, job["id"], lambda j: j["world_size"] == 3, 180, "both nodes back")
    losses = succeeded_without_restart(api, job["id"])
    print("in place, two kills in a row:", losses)
    # Seen as one quorum change or as two: either way 3 -> 1, each redoing at most a step.
    assert losses and losses[0]["from_world"] == 3 and losses[-1]["to_world"] == 1, losses
    assert all(x["pause_seconds"] < TWO_LOSSES_PAUSE_BOUND_S for x in losses), losses
    first_loss = events(api, job["id"], "worker_lost")[0]["seq"]
    joined = [e["data"] for e in events(api, job["id"], "joined") if e["seq"] > first_loss]
    print("in place, joins after two kills:", joined)
    assert joined and joined[-1]["to_world"] == 3, joined
    assert all(j["steps_redone"] == 0 for j in joined), joined
    assert all(j["pause_seconds"] < JOIN_PAUSE_BOUND_S for j in joined), joined
    assert_exact(api, job["id"], root)


# Two nodes lost 0.3 s apart: the lighthouse drops the first after its 0.3 s heartbeat
# timeout, so the survivors' next quorum can hold the second replica, which dies while that
# quorum's process group forms (64 s was seen before the rendezvous timeout). The goal is 2 s
# from the first kill.


def test_two_nodes_lost_a_moment_apart_pause_the_survivor_briefly(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    tmp_path: Path,
    machine_share: MachineShare,
) -> None:
    """Two nodes of one rack fail 0.3 s apart: the last replica trains on within the bound,
    in the same attempt, and ends on the uninterrupted run's model. Whether the second
    replica is inside the survivor's next quorum when it dies depends on tens of
    milliseconds: tests/unit/elastic/in_place/test_rendezvous.py proves that case every time."""
    root = tmp_path / "checkpoints"
    # Timed alone, from the submission: 0.7 s on the quiet machine, it reached 2.06 s beside
    # the other xdist worker's five-node hosts test.
    with machine_share.alone():
        job = start_at_three_replicas(api, root)
        first_killed = pool.kill_nodes_apart([pool.pool[0], pool.pool[1]], 0.3)
        at_one = wait_until(api, job["id"], lambda j: j["world_size"] == 1, 60, "1 replica")
        wait_until(api, job["id"], lambda j: j["step"] >= at_one["step"] + 10, 60, "training alone")
    pause = longest_pause_after(first_killed, events(api, job["id"], "metrics"))
    print(f"in place, two nodes lost 0.3 s apart: {pause:.2f} s from the first kill")
    assert pause <= TWO_LOSSES_PAUSE_BOUND_S, pause
    pool.add_node()
    pool.add_node()
    wait_until(api, job["id"], lambda j: j["world_size"] == 3, 180, "both nodes back")
    losses = succeeded_without_restart(api, job["id"])
    # Seen as one quorum change or as two: 3 -> 1 either way.
    changes = [(x["from_world"], x["to_world"]) for x in losses]
    assert changes[:1] == [(3, 1)] or changes[:2] == [(3, 2), (2, 1)], losses
    assert_exact(api, job["id"], root)


# The bound on the pause a supervisor's loss may cost an in-place job.
SUPERVISOR_LOSS_PAUSE_BOUND_S = 2.0


def test_a_killed_supervisor_s_replicas_train_on_under_its_successor(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The supervisor's process is SIGKILLed mid-run. Its replicas and their lighthouse
    outlive it and train on; the service re-creates the supervisor, which adopts their
    attempt: no restart, the same processes, a pause of at most 2 s, and every step's metrics
    once, those sent while no supervisor listened included. A node lost after that is
    replaced by the new supervisor, its replica healed from a peer: with ``keep: 1`` the
    checkpoints of the attempt's early steps are long gone."""
    root = tmp_path / "checkpoints"
    spec = in_place_job(STEPS)
    spec["checkpoint"]["keep"] = 1
    job = start_at_three_replicas(api, root, spec)
    wait_until(api, job["id"], lambda j: j["step"] >= 25, 120, "a checkpoint")
    old = replica_pids()
    assert len(old) == 3, old
    supervisor = ray.get_actor(launcher.supervisor_name(job["id"]), namespace=NAMESPACE)
    where = process_of(supervisor)
    assert where is not None
    at_kill = api.get(f"/v1/jobs/{job['id']}").json()["step"]
    os.kill(where[0], signal.SIGKILL)
    (note,) = wait_for(
        lambda: [e["data"] for e in events(api, job["id"], "supervisor_recreated")],
        120,
        what="the supervisor re-created",
    )
    assert note == {"previous_state": "running", "adopted_attempt": 1}, note
    wait_until(api, job["id"], lambda j: j["step"] >= at_kill + 30, 120, "steps past the kill")
    assert replica_pids() == old  # the same replicas: none was restarted
    pauses = [e["data"]["longest_pause_s"] for e in events(api, job["id"], "metrics")]
    print(f"in place, the supervisor killed: longest pause {max(pauses):.2f} s")
    assert max(pauses) <= SUPERVISOR_LOSS_PAUSE_BOUND_S, max(pauses)
    pool.kill_node(pool.pool[1])
    wait_until(api, job["id"], lambda j: j["world_size"] == 2, 60, "2 replicas")
    pool.add_node()
    wait_until(api, job["id"], lambda j: j["world_size"] == 3, 180, "the node's replica back")
    losses = succeeded_without_restart(api, job["id"])
    assert [(x["from_world"], x["to_world"]) for x in losses] == [(3, 2)], losses
    states = [e["data"]["state"] for e in events(api, job["id"], "state")]
    assert states == ["queued", "starting", "running", "succeeded"]
    assert not events(api, job["id"], "restored")
    steps = Counter(e["data"]["step"] for e in events(api, job["id"], "metrics"))
    assert set(steps.values()) == {1} and set(steps) == set(range(min(steps), STEPS + 1))
    lost = events(api, job["id"], "worker_lost")[-1]["seq"]
    joined = [e["data"] for e in events(api, job["id"], "joined") if e["seq"] > lost]
    assert [(j["from_world"], j["to_world"]) for j in joined] == [(2, 3)], joined
    assert_exact(api, job["id"], root)
    # Its replicas ended with it.
    prefix = f"{launcher.supervisor_name(job['id'])}-a"
    wait_for(
        lambda: (
            not [
                a
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(prefix)
            ]
        ),
        30,
        what="no replica of the job left",
    )


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "T"
    except OSError:
        return False


def test_a_node_killed_while_a_replacement_starts_leaves_the_job_exact(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A survivor's node dies while the replica placed on a node added back is starting
    (its process is up, it has not joined yet): the joiner heals from whichever replica is
    left, and the job trains on without a restart, exact."""
    root = tmp_path / "checkpoints"
    job = start_at_three_replicas(api, root)
    pool.kill_node(pool.pool[0])
    wait_until(api, job["id"], lambda j: j["world_size"] == 2, 60, "2 replicas")
    before = set(replica_pids())
    pool.add_node()
    wait_until(
        api,
        job["id"],
        lambda j: bool(set(replica_pids()) - before),
        120,
        "the replacement's process",
    )
    pool.kill_node(pool.pool[0])  # a survivor's node; the new node is the pool's last
    pool.add_node()
    wait_until(api, job["id"], lambda j: j["world_size"] == 3, 180, "3 replicas again")
    losses = succeeded_without_restart(api, job["id"])
    print("in place, a kill while a replacement starts:", losses)
    assert len(losses) == 2, losses
    # The replacement had not joined when the survivor's node died: in the job's own order
    # of events, no join comes between the two losses.
    first_loss, second_loss = [e["seq"] for e in events(api, job["id"], "worker_lost")]
    joins = events(api, job["id"], "joined")
    assert not [e for e in joins if first_loss < e["seq"] < second_loss], joins
    joined = [e["data"] for e in joins]
    assert all(j["steps_redone"] == 0 for j in joined), joined
    assert_exact(api, job["id"], root)


def test_the_peer_sending_state_to_a_joiner_dies_and_the_joiner_heals_from_another(
    api: httpx.Client,  # noqa: F811
    pool: ClusterPool,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A node is lost, a node added back; a survivor sends its state to the new replica and
    its node dies halfway, after the metadata and the first tensor. The joiner never trains
    on the half-sent state: it heals from the other survivor, the job goes on without a
    restart, exact, and every replica ends on the same parameters."""
    arm, release = tmp_path / "heal-arm", tmp_path / "heal-release"
    pace = tmp_path / "pace"
    spec = in_place_job(STEPS)
    spec["workload"] = "tests.workloads.held_heal:train_loop"
    spec["hyperparameters"].update(heal_arm=str(arm), heal_release=str(release), pace=str(pace))
    job = start_at_three_replicas(api, tmp_path / "checkpoints", spec)
    pool.kill_node(pool.pool[0])
    at_two = wait_until(api, job["id"], lambda j: j["world_size"] == 2, 60, "2 replicas")
    wait_until(api, job["id"], lambda j: j["step"] >= at_two["step"] + 5, 60, "training at 2")
    arm.touch()  # the next heal is held
    pace.touch()  # the job trains on until the last joiner has started
    pool.add_node()

    def sender() -> str | None:
        lines = api.get(f"/v1/jobs/{job['id']}/logs", params={"limit": 5000}).json()["items"]
        said = [x["line"] for x in lines if "[held-heal] sent part of its state" in x["line"]]
        return said[0].rsplit(" ", 1)[1] if said else None

    node_id = wait_for(sender, 180, interval=0.1, what="a survivor sending its state")
    (victim,) = [n for n in pool.pool if n.node_id == node_id]
    pool.kill_node(victim)
    release.touch()
    wait_until(api, job["id"], lambda j: j["world_size"] == 2, 60, "the joiner healed")
    pool.add_node()
    wait_until(api, job["id"], lambda j: j["world_size"] == 3, 180, "3 replicas again")
    pace.unlink()
    losses = succeeded_without_restart(api, job["id"])
    print("in place, the heal's sender killed:", losses)
    # Both losses reported, each naming the one replica it lost. The second is usually
    # 2 -> 2 (the joiner healed in the same quorum change), or 2 -> 1 when the quorum
    # formed before the joiner asked again.
    assert [(x["from_world"], len(x["replicas"])) for x in losses] == [(3, 1), (2, 1)], losses
    assert losses[0]["to_world"] == 2 and losses[1]["to_world"] in (1, 2), losses
    assert_exact(api, job["id"], tmp_path / "checkpoints")
    # The three replicas at the end (the survivor, the joiner that healed from it, and the
    # last one added) hold the model the final checkpoint holds.
    lines = api.get(f"/v1/jobs/{job['id']}/logs", params={"limit": 5000}).json()["items"]
    digests = [
        x["line"].rsplit(" ", 1)[1] for x in lines if "[held-heal] final parameters" in x["line"]
    ]
    newest = api.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"][-1]
    saved = torch.load(
        tmp_path / "checkpoints" / job["id"] / newest["path"] / "state.pt", weights_only=True
    )
    assert digests == [parameters_digest(saved["model"].values())] * 3, digests
