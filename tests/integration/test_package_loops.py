"""A ``train_loop`` uploaded with its job: run with the ``ctx`` API in a confined child of
each worker (never in the worker, which holds Ray), elastic by restart from the context's
checkpoints or in place (the child of each replica builds its torchft manager), on a real
Ray cluster through the real service."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from elastic.train.context import run_with_context
from elastic.train.current import call_train_loop
from elastic.train.worker import WorkerContext
from elastic_train import Client
from elastic_train.errors import InvalidRequest
from jobs.launcher import files_dir
from tests.conftest import TOKEN, ClusterPool, LiveServer, all_events, wait_for
from tests.integration.test_command_jobs import ended, log_text

LOOP_DIR = Path(__file__).parents[1] / "workloads" / "package_loop"


def loop_job(
    steps: int, workers: int = 2, pace_s: float = 0.0, fault_tolerance: str | None = "restart"
) -> dict[str, Any]:
    """The package loop's job; restart mode unless told (None: the service's default)."""
    return {
        "name": "package-loop",
        **({} if fault_tolerance is None else {"fault_tolerance": fault_tolerance}),
        "entrypoint": "train.py:train_loop",
        "hyperparameters": {"steps": steps, "pace_s": pace_s},
        "scaling": {"min_workers": 1, "max_workers": workers, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 5, "keep": 2},
        "failure": {"max_restarts": 3, "min_workers_grace_s": 60},
    }


def reference(
    steps: int, tmp: Path, entrypoint: str = "train.py:train_loop", args: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The same loop in one process, never interrupted: ``train.py``'s ``train_loop`` for
    ``steps``, or the script-style ``main()`` an entrypoint names, given ``args``."""
    file, _, function = entrypoint.partition(":")
    sys.path.insert(0, str(LOOP_DIR))
    try:
        name = f"package_loop_{Path(file).stem}"
        spec = importlib.util.spec_from_file_location(name, LOOP_DIR / file)
        assert spec is not None and spec.loader is not None
        module: Any = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        worker = WorkerContext.standalone(0, 1, str(tmp), every_steps=1000)
        states: list[dict[str, torch.Tensor]] = []

        def loop(config: dict[str, Any], ctx: Any) -> None:
            call_train_loop(getattr(module, function), config, ctx)
            states.append({k: v.clone() for k, v in ctx.model.state_dict().items()})

        hyperparameters = {"steps": steps} if args is None else {"args": args}
        run_with_context(loop, {"hyperparameters": hyperparameters, "_elastic": {}}, worker)
    finally:
        sys.path.remove(str(LOOP_DIR))
    assert states, "the loop did not end"
    return states[0]


def final_state(server: LiveServer, job_id: str) -> dict[str, Any]:
    root = server.settings.resolved_checkpoint_dir
    return torch.load(Path(files_dir(root, "admin", job_id)) / "final.pt")  # type: ignore[no-any-return]


def assert_matches(state: dict[str, Any], steps: int, tmp: Path, **loop: Any) -> None:
    assert state["step"] == steps
    for name, value in reference(steps, tmp, **loop).items():
        got = state["model"][name.removeprefix("module.")]
        assert got.dtype == torch.float64
        assert torch.allclose(got, value, rtol=0, atol=1e-12), name


def test_a_train_loop_from_the_package_runs_confined_and_trains_as_one_process(
    server: LiveServer, tmp_path: Path
) -> None:
    api = server.client()
    with Client(server.url, TOKEN) as client:
        job = client.submit(loop_job(40), code=LOOP_DIR)
    info = api.get(f"/v1/jobs/{job.id}").json()
    assert info["spec"]["workload"] == "train.py:train_loop"
    assert info["spec"]["fault_tolerance"] == "restart"
    final = ended(api, job.id, timeout=180)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    assert final["step"] == 40
    # The loop ran in a process of its own, which never loaded Ray.
    assert "loop: rank 0 of 2, ray loaded: False" in text
    assert "done at step 40" in text
    checkpoints = api.get(f"/v1/jobs/{job.id}/checkpoints").json()
    assert [c["step"] for c in checkpoints["items"]] == [35, 40]
    steps = [e["data"]["step"] for e in all_events(api, job.id, "metrics") if "loss" in e["data"]]
    assert steps == list(range(1, 41))
    assert_matches(final_state(server, job.id), 40, tmp_path)


def test_a_package_loop_survives_a_node_loss_and_grows_back_unchanged(
    server: LiveServer, ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    """A node lost at 3 workers: the attempt restarts at 2 from the latest checkpoint;
    the node back, the job pauses at a checkpoint and grows to 3. The model at the end is
    the uninterrupted run's."""
    api = server.client()
    steps = 90
    with Client(server.url, TOKEN) as client:
        job = client.submit(loop_job(steps, workers=3, pace_s=0.15), code=LOOP_DIR)

    def view() -> dict[str, Any]:
        return api.get(f"/v1/jobs/{job.id}").json()  # type: ignore[no-any-return]

    wait_for(lambda: (j := view())["step"] >= 12 and j["world_size"] == 3, 120, what="step 12 at 3")
    ray_cluster.kill_node(ray_cluster.pool[1])

    def trained_at(world: int) -> bool:
        points = all_events(api, job.id, "metrics")
        return any(p["data"].get("world_size") == world and "loss" in p["data"] for p in points)

    wait_for(lambda: trained_at(2), 120, what="training at 2")
    ray_cluster.add_node()
    final = ended(api, job.id, timeout=240)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    assert final["step"] == steps
    sizes = [e["data"]["world_size"] for e in all_events(api, job.id, "attempt_started")]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert_matches(final_state(server, job.id), steps, tmp_path)


def test_a_misspelt_loop_is_refused_at_submission(server: LiveServer) -> None:
    with Client(server.url, TOKEN) as client:
        spec = {**loop_job(5), "entrypoint": "train.py:train_lop"}
        try:
            client.submit(spec, code=LOOP_DIR)
        except InvalidRequest as e:
            assert e.status == 422
            assert "train.py defines no 'train_lop'" in str(e)
        else:
            raise AssertionError("a misspelt train_loop was accepted")
        spec = {**loop_job(5), "entrypoint": "trainer.py:train_loop"}
        try:
            client.submit(spec, code=LOOP_DIR)
        except InvalidRequest as e:
            assert e.status == 422
            assert "the code package has no trainer.py" in str(e)
        else:
            raise AssertionError("a loop in a missing file was accepted")


def test_a_loop_that_cannot_import_fails_at_once_without_retries(
    server: LiveServer, tmp_path: Path
) -> None:
    package = tmp_path / "broken"
    package.mkdir()
    (package / "train.py").write_text(
        "import not_a_module_anywhere\n\ndef train_loop(config, ctx):\n    pass\n"
    )
    api = server.client()
    with Client(server.url, TOKEN) as client:
        job = client.submit({**loop_job(5), "failure": {"max_restarts": 3}}, code=package)
    final = ended(api, job.id, timeout=120)
    assert final["state"] == "failed"
    assert "No module named 'not_a_module_anywhere'" in final["message"], final
    assert len(all_events(api, job.id, "attempt_started")) == 1


def job_replica_actors(job_id: str) -> list[int]:
    """The in-place replica actors running this job's package loop: the parents of the
    confined children whose checkpoint directory is the job's (other tests' replicas may
    run on this machine at the same time)."""
    actors = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        own = any(v.startswith(b"ETRAIN_CHECKPOINT_DIR=") and job_id.encode() in v for v in environ)
        if b"elastic.in_place.replica_child" not in cmdline or not own:
            continue
        pid = int(entry)
        while pid > 1:  # up through the confinement's own processes, if any
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::Replica."):
                    actors.add(pid)
                    break
            except OSError:
                break
            pid = int(stat.rsplit(")", 1)[1].split()[1])
    return sorted(actors)


# The loop's own sleep after each step: part of every step, so of the pause around a loss too
# (the step in flight before it and the step redone after it).
IN_PLACE_PACE_S = 0.05


def test_a_package_loop_in_place_survives_a_node_loss_without_a_restart(
    server: LiveServer, ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    """In place: a node lost at 3 replicas, the survivors train on in the same attempt,
    paused no longer than a built-in loop's; the node back, a replica joins healed from a
    peer; then a replica's actor hangs, and its child stops with it. The loop is the
    script-style one (``script.py:main``: argparse, its DataLoader in ``ctx.loader``, an
    epoch function). The model at the end is the uninterrupted run's."""
    from elastic.in_place.child_link import PARENT_SILENT_S
    from tests.integration.test_in_place import LOSS_PAUSE_BOUND_S, stopped

    api = server.client()
    # Enough steps (about 0.1 s each at 2 replicas here) for the node added back and its
    # replica's start (Ray, then torch in the actor and in its child) before the job ends.
    epochs = 60  # 16 steps an epoch
    steps = epochs * 16
    args = ["--epochs", str(epochs), "--pace", str(IN_PLACE_PACE_S)]
    spec = {
        **loop_job(steps, workers=3, fault_tolerance="in_place"),
        "entrypoint": "script.py:main",
        "hyperparameters": {"args": args},
    }
    with Client(server.url, TOKEN) as client:
        job = client.submit(spec, code=LOOP_DIR)

    def view() -> dict[str, Any]:
        return api.get(f"/v1/jobs/{job.id}").json()  # type: ignore[no-any-return]

    assert view()["spec"]["fault_tolerance"] == "in_place"
    wait_for(lambda: (j := view())["step"] >= 15 and j["world_size"] == 3, 180, what="step 15 at 3")
    ray_cluster.kill_node(ray_cluster.pool[1])
    wait_for(lambda: view()["world_size"] == 2, 60, what="training on at 2")
    ray_cluster.add_node()

    def until(what: str, condition: Any, timeout_s: float) -> None:
        try:
            wait_for(condition, timeout_s, what=what)
        except AssertionError as e:
            kinds = [
                (ev["kind"], ev["data"])
                for ev in all_events(api, job.id)
                if ev["kind"] not in ("log", "metrics")
            ]
            raise AssertionError(
                f"{e}\n{view()}\nevents: {kinds}\nlog:\n{log_text(api, job.id)[-6000:]}"
            ) from None

    until("a replica joined back", lambda: view()["world_size"] == 3, 120)
    # A hung actor (stopped): its child, which heartbeats to the lighthouse itself, hears no
    # more pings and stops, so the replica is dropped and the actor fenced as any hung
    # replica is; a replacement joins on the freed slot.
    (hung, *_) = job_replica_actors(job.id)
    os.kill(hung, signal.SIGSTOP)
    try:
        until("the hung replica dropped", lambda: view()["world_size"] == 2, 30)
        until("the hung replica killed", lambda: not stopped(hung), 30)
        until("its replacement joined", lambda: view()["world_size"] == 3, 120)
    finally:
        if stopped(hung):
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
    final = ended(api, job.id, timeout=240)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    assert final["step"] == steps
    # No restart: the survivors never left the attempt.
    assert len(all_events(api, job.id, "attempt_started")) == 1
    losses = [e["data"] for e in all_events(api, job.id, "worker_lost")]
    print("package loop in place, losses:", losses)
    assert [(x["from_world"], x["to_world"]) for x in losses] == [(3, 2), (3, 2)], losses
    # The node's loss: as short as a built-in loop's. The hung actor's: its child's wait for
    # a ping (PARENT_SILENT_S) comes first.
    assert losses[0]["pause_seconds"] < LOSS_PAUSE_BOUND_S + 2 * IN_PLACE_PACE_S, losses
    assert losses[1]["pause_seconds"] < PARENT_SILENT_S + LOSS_PAUSE_BOUND_S, losses
    joined = [e["data"] for e in all_events(api, job.id, "joined")]
    assert [(j["from_world"], j["to_world"]) for j in joined].count((2, 3)) >= 2, joined
    # Every replica's loop ran in a process of its own, which never loaded Ray.
    assert "ray loaded: False" in text and "ray loaded: True" not in text
    assert f"done at step {steps}" in text
    assert_matches(
        final_state(server, job.id), steps, tmp_path, entrypoint="script.py:main", args=args
    )


def test_a_loop_that_cannot_import_fails_in_place_at_once(
    server: LiveServer, tmp_path: Path
) -> None:
    package = tmp_path / "broken"
    package.mkdir()
    (package / "train.py").write_text(
        "import not_a_module_anywhere\n\ndef train_loop(config, ctx):\n    pass\n"
    )
    api = server.client()
    spec = {**loop_job(5, fault_tolerance="in_place"), "failure": {"max_restarts": 3}}
    with Client(server.url, TOKEN) as client:
        job = client.submit(spec, code=package)
    final = ended(api, job.id, timeout=120)
    assert final["state"] == "failed"
    assert "No module named 'not_a_module_anywhere'" in final["message"], final
    assert len(all_events(api, job.id, "attempt_started")) == 1
