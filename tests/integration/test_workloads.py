"""The workloads end to end: submitted over HTTP to the real service, trained by Ray Train
workers on the session's Ray cluster; and the documented custom training loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from elastic.checkpoint.writer import load_model, sharded_reader
from elastic.train.context import run_with_context
from elastic.train.worker import WorkerContext
from examples import custom_train_loop
from jobs.spec import JobSpec
from jobs.workloads.text_classification import TextEncoderClassifier
from tests.conftest import LiveServer, wait_until_ended
from tests.workloads import digits, sentiment


def metrics(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    items = client.get(
        f"/v1/jobs/{job_id}/events", params={"kind": "metrics", "limit": 5000}
    ).json()["items"]
    return [e["data"] for e in items]


def test_text_classification_trains_sharded_over_2_workers(
    server: LiveServer, tmp_path: Path
) -> None:
    data = sentiment.write(tmp_path / "reviews.jsonl", 600)
    spec = {
        "name": "reviews",
        "workload": "text-classification",
        "hyperparameters": {
            "data_path": str(data),
            "eval_fraction": 0.2,
            "epochs": 4,
            "global_batch_size": 32,
            "width": 32,
            "heads": 2,
            "layers": 1,
            "max_length": 16,
            "learning_rate": 0.01,
            "dropout": 0.0,
        },
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 30, "keep": 2},
        "distributed": {"strategy": "fsdp"},
    }
    client = server.client()
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job = wait_until_ended(client, r.json()["id"])
    assert job["state"] == "succeeded", job
    reports = metrics(client, job["id"])
    steps = 4 * 15  # 480 training reviews, 32 per step
    assert job["step"] == steps and {m["world_size"] for m in reports} == {2}
    evals = [(m["step"], m["eval_accuracy"]) for m in reports if "eval_accuracy" in m]
    assert [s for s, _ in evals] == [15, 30, 45, 60]  # after each epoch
    assert evals[-1][1] >= 0.9, evals
    # Each rank checkpointed its own shards; they load into one unsharded model.
    newest = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"][-1]
    job_dir = Path(server.settings.resolved_checkpoint_dir) / job["id"]
    checkpoint = job_dir / newest["path"]
    assert sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    assert state["step"] == steps and "model" not in state
    layout = sharded_reader(checkpoint / "sharded").read_metadata().state_dict_metadata
    vocab = layout["model.tokens.weight"].size[0]  # type: ignore[union-attr]
    model = TextEncoderClassifier(vocab, 2, 16, 32, 2, 1, 128, 0.0)
    before = model.tokens.weight.detach().clone()
    load_model(checkpoint, model)
    assert not torch.equal(model.tokens.weight, before)


def test_the_image_workload_learns_real_digits_on_2_workers(
    server: LiveServer, tmp_path: Path
) -> None:
    """scikit-learn's bundled 8x8 digits (1437 training, 360 held-out images): at least 95%
    held-out accuracy after 10 epochs on 2 workers."""
    train, held_out = digits.write_imagefolders(tmp_path / "digits")
    spec = {
        "name": "digits",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "imagefolder",
            "data_path": str(train),
            "eval_path": str(held_out),
            "image_size": 8,
            "augment": "none",
            "num_classes": 10,
            "epochs": 10,
            "global_batch_size": 64,
            "learning_rate": 0.1,
            "lr_schedule": "cosine",
            "report_every_steps": 23,
        },
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 100, "keep": 1},
    }
    client = server.client()
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job = wait_until_ended(client, r.json()["id"])
    assert job["state"] == "succeeded", job
    evals = [m["eval_accuracy"] for m in metrics(client, job["id"]) if "eval_accuracy" in m]
    assert len(evals) == 10
    assert evals[-1] >= 0.95, evals


def test_the_documented_custom_loop_trains_and_resumes(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "custom",
            "workload": "examples.custom_train_loop:train_loop",
            "hyperparameters": {"epochs": 4, "global_batch_size": 128, "report_every_steps": 8},
            "checkpoint": {"every_steps": 32},
        }
    )
    whole = WorkerContext.standalone(0, 1, str(tmp_path / "a"), every_steps=32)
    run_with_context(custom_train_loop.train_loop, spec.train_config(), whole)
    evals = [d["eval_loss"] for k, d in whole.local_events if k == "metrics" and "eval_loss" in d]
    assert len(evals) == 4 and evals[-1] < 0.25 * evals[0], evals

    # From the checkpoint of step 64, as a restarted attempt would: the same end state.
    resumed = WorkerContext.standalone(
        0,
        1,
        str(tmp_path / "b"),
        every_steps=32,
        resume_path=str(tmp_path / "a" / "step_0000000064"),
    )
    run_with_context(custom_train_loop.train_loop, spec.train_config(), resumed)
    steps = [d["step"] for k, d in resumed.local_events if k == "metrics"]
    assert steps[0] == 65 and steps[-1] == 128
    ours = torch.load(tmp_path / "b" / "step_0000000128" / "state.pt", weights_only=True)
    ref = torch.load(tmp_path / "a" / "step_0000000128" / "state.pt", weights_only=True)
    for name, tensor in ref["model"].items():
        assert torch.equal(ours["model"][name], tensor), name


@pytest.mark.parametrize("path", ["reviews.csv", "reviews.jsonl"])
def test_text_files_in_both_formats_read_the_same(tmp_path: Path, path: str) -> None:
    from jobs.workloads.text_classification import read_examples

    rows = read_examples(str(sentiment.write(tmp_path / path, 10)))
    assert rows == sentiment.reviews(10, 0)


def test_a_last_batch_smaller_than_the_world_trains_through(server: LiveServer) -> None:
    """65 samples in batches of 64 on 2 workers: every second step has 1 sample, so one
    worker's share is empty (it used to crash the job in the data loader)."""
    spec = {
        "name": "short-last-batch",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "synthetic_samples": 65,
            "image_size": 8,
            "num_classes": 2,
            "epochs": 3,
            "global_batch_size": 64,
        },
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 2, "keep": 1},
    }
    client = server.client()
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job = wait_until_ended(client, r.json()["id"])
    assert job["state"] == "succeeded", job
    reports = metrics(client, job["id"])
    assert [m["step"] for m in reports] == [1, 2, 3, 4, 5, 6]
    assert {m["world_size"] for m in reports} == {2}
