"""MLflow logging against a real tracking store (SQLite under tmp_path), read back with
MLflow's own client: one run per job, across a re-created supervisor."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from jobs import launcher
from tests.conftest import (
    NAMESPACE,
    LiveServer,
    make_settings,
    small_job,
    wait_for,
    wait_until_ended,
)

mlflow = pytest.importorskip("mlflow")

EXPERIMENT = "etrain-tests"
HOLD_AT = 12  # past the checkpoint of step 10, so the second attempt redoes 11 and 12
STEPS = 30


@pytest.fixture
def live(ray_cluster: Any, tmp_path: Path) -> Iterator[LiveServer]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The store exists before any job, as a tracking server would: the first MlflowClient on
    # an empty SQLite file migrates its schema, and a worker killed half-way through that
    # would leave it broken.
    mlflow.MlflowClient(tracking_uri=uri).create_experiment(EXPERIMENT)
    settings = make_settings(
        tmp_path,
        entrypoint_modules=["tests.workloads"],
        mlflow_tracking_uri=uri,
        mlflow_experiment=EXPERIMENT,
    )
    with LiveServer(settings) as server:
        yield server
    launcher.configure_mlflow(None)  # the next test's server in this process logs nowhere


def test_a_job_logs_one_run_that_a_recreated_supervisor_continues(
    live: LiveServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    spec = small_job(gate=str(gate), hold_at_step=HOLD_AT, max_steps=STEPS)
    spec["workload"] = "tests.workloads.gated:train_loop"
    spec["name"] = "mlflow-job"
    # Restart mode: its attempt dies with the supervisor, and the new one's attempt must find
    # the job's run (in place, the new supervisor adopts the running attempt instead).
    spec["fault_tolerance"] = "restart"
    client = mlflow.MlflowClient(tracking_uri=live.settings.mlflow_tracking_uri.get_secret_value())
    experiment = client.get_experiment_by_name(EXPERIMENT)

    def held_point_logged() -> bool:
        runs = client.search_runs([experiment.experiment_id])
        return bool(runs) and any(
            m.step == HOLD_AT for m in client.get_metric_history(runs[0].info.run_id, "train/loss")
        )

    with live.client() as api:
        job = api.post("/v1/jobs", json=spec).json()
        try:
            wait_for(
                lambda: api.get(f"/v1/jobs/{job['id']}").json()["step"] >= HOLD_AT,
                timeout=120,
                what="the job to reach the gate",
            )
            wait_for(held_point_logged, timeout=60, what="the held step's loss in MLflow")
            # The attempt dies with its supervisor; the service starts a new one from step 10.
            supervisor = ray.get_actor(launcher.supervisor_name(job["id"]), namespace=NAMESPACE)
            ray.kill(supervisor, no_restart=True)
            gate.touch()
            done = wait_until_ended(api, job["id"], 180)
        finally:
            gate.touch()
        assert done["state"] == "succeeded" and done["step"] == STEPS
        series = api.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
        started = [
            e["data"]
            for e in api.get(f"/v1/jobs/{job['id']}/events").json()["items"]
            if e["kind"] == "attempt_started"
        ]
    attempts = [a["attempt"] for a in started]
    sizes = [a["world_size"] for a in started]
    # The re-created supervisor starts at what is free: on a loaded machine the killed one's
    # workers were once not handed back yet, and it began at 1 (a fresh clone, 2026-11-28);
    # it may then grow back to 2, a third attempt.
    assert sizes in ([2, 2], [2, 1], [2, 1, 2]), sizes

    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the re-created supervisor's attempt found the job's run
    (run,) = runs
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "mlflow-job"
    assert run.data.tags["etrain.job_id"] == job["id"]
    assert run.data.tags[f"etrain.attempt.{attempts[0]}"] == "began at world size 2, from the start"
    assert (
        run.data.tags[f"etrain.attempt.{attempts[1]}"]
        == f"began at world size {sizes[1]}, from the checkpoint of step 10"
    )
    if len(attempts) == 3:
        grew = run.data.tags[f"etrain.attempt.{attempts[2]}"]
        assert grew.startswith("began at world size 2, from the checkpoint of step "), grew
    assert run.data.params["hyperparameters.max_steps"] == str(STEPS)
    assert run.data.params["hyperparameters.gate"] == str(gate)
    assert run.data.params["etrain.min_workers"] == "1"
    assert run.data.params["etrain.max_workers"] == "2"

    loss = client.get_metric_history(run.info.run_id, "train/loss")
    # Point for point what the API serves: the redone steps 11 and 12 are there twice in both
    # (the failed attempt's and the re-created one's), the last at the job's last step.
    assert sorted(m.step for m in loss) == sorted(series["step"])
    assert series["step"].count(HOLD_AT) == 2
    ours = sorted((m.step, m.value) for m in loss)
    api_points = sorted(zip(series["step"], series["loss"], strict=True))
    assert [v for _, v in ours] == pytest.approx([v for _, v in api_points], rel=1e-12)
    last = max(loss, key=lambda m: (m.step, m.timestamp))
    assert last.step == STEPS == series["step"][-1]
    assert last.value == pytest.approx(series["loss"][-1], rel=1e-12)
    assert run.data.metrics["train/world_size"] == sizes[-1]
    world = client.get_metric_history(run.info.run_id, "train/world_size")
    assert {m.value for m in world} == set(map(float, sizes))


def test_the_service_refuses_to_start_with_a_tracking_uri_and_no_mlflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import ValidationError

    # How Python itself marks a module that cannot be imported.
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ValidationError, match="mlflow is not installed: pip install"):
        make_settings(tmp_path, mlflow_tracking_uri="sqlite:///x.db")
