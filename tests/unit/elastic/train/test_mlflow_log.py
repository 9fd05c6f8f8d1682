"""elastic.train.mlflow_log against a real SQLite tracking store, without Ray: attempts of one job
share its run, and the run's status follows how each attempt ended."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.train import mlflow_log

mlflow = pytest.importorskip("mlflow")

CONFIG = {
    "hyperparameters": {"learning_rate": 0.1, "nested": {"odd key!": 3}},
    "distributed": {"strategy": "ddp"},
    "_mlflow": {"job_id": "job-42", "job_name": "demo", "min_workers": 1, "max_workers": 2},
}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    client.create_experiment("unit")
    monkeypatch.setenv(mlflow_log.URI_VARIABLE, uri)
    monkeypatch.setenv(mlflow_log.EXPERIMENT_VARIABLE, "unit")
    return client


def the_run(client: object) -> object:
    experiment = client.get_experiment_by_name("unit")  # type: ignore[attr-defined]
    (run,) = client.search_runs([experiment.experiment_id])  # type: ignore[attr-defined]
    return run


def attempt(number: int, world: int, start: int, steps: list[int], total: int) -> None:
    log = mlflow_log.for_worker(CONFIG, number, world, start)
    assert log is not None
    for step in steps:
        log.record("metrics", {"step": step, "loss": 1 / step, "total_steps": total})
    log.close()


def test_a_failed_attempt_fails_the_run_and_the_next_one_finishes_it(store: object) -> None:
    try:
        raise RuntimeError("a collective lost its peer")
    except RuntimeError:
        attempt(1, 2, 0, [1, 5], total=10)  # close() while the exception is handled
    run = the_run(store)
    assert run.info.status == "FAILED"  # type: ignore[attr-defined]
    attempt(3, 1, 0, [1, 5, 10], total=10)
    run = the_run(store)  # still the one run
    assert run.info.status == "FINISHED"  # type: ignore[attr-defined]
    assert run.data.tags["etrain.attempt.1"] == "began at world size 2, from the start"  # type: ignore[attr-defined]
    assert run.data.tags["etrain.attempt.3"] == "began at world size 1, from the start"  # type: ignore[attr-defined]
    assert run.data.params["hyperparameters.nested.odd key_"] == "3"  # type: ignore[attr-defined]
    history = store.get_metric_history(run.info.run_id, "train/loss")  # type: ignore[attr-defined]
    assert sorted(m.step for m in history) == [1, 1, 5, 5, 10]


def test_a_paused_attempt_leaves_the_run_running(store: object) -> None:
    attempt(1, 1, 0, [1, 5], total=10)  # paused for a resize at step 5: no exception
    assert the_run(store).info.status == "RUNNING"  # type: ignore[attr-defined]


def test_no_uri_or_no_job_means_no_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mlflow_log.URI_VARIABLE, raising=False)
    assert mlflow_log.for_worker(CONFIG, 1, 1, 0) is None
    monkeypatch.setenv(mlflow_log.URI_VARIABLE, "sqlite:///unused.db")
    assert mlflow_log.for_worker({"hyperparameters": {}}, 1, 1, 0) is None
