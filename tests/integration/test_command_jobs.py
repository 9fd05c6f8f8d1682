"""Command jobs: a user's script, unchanged, run by every worker with torchrun's
environment, on a real Ray cluster through the real service."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs.code_store import CodeStore
from jobs.launcher import files_dir
from tests.conftest import (
    LiveServer,
    all_events,
    wait_for,
    wait_until_ended,
)

SCRIPT_DIR = Path(__file__).parents[1] / "workloads" / "torchrun_script"


def _package(directory: Path) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for path in sorted(directory.rglob("*.py")):
            archive.add(path, arcname=str(path.relative_to(directory)))
    return out.getvalue()


def _upload(server: LiveServer, owner: str) -> str:
    import hashlib

    data = _package(SCRIPT_DIR)
    package_id = hashlib.sha256(data).hexdigest()
    CodeStore(server.settings.resolved_checkpoint_dir).put(owner, package_id, data)
    return package_id


def reference(steps: int) -> dict[str, torch.Tensor]:
    """The script's model after ``steps`` steps in one process, never interrupted."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torchrun_script", SCRIPT_DIR / "train.py")
    assert spec is not None and spec.loader is not None
    script: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = script.batch(step)
        loss = ((model(x) - y) ** 2).sum() / script.GLOBAL_BATCH
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def command_job(package: str, *args: str, workers: int = 2) -> dict[str, Any]:
    return {
        "name": "script",
        "command": ["python", "train.py", *args],
        "code": package,
        "scaling": {"min_workers": 1, "max_workers": workers, "cpus_per_worker": 1},
        "failure": {"max_restarts": 3, "min_workers_grace_s": 60},
    }


def test_a_torchrun_script_runs_unchanged_on_two_workers(server: LiveServer) -> None:
    client = server.client()
    package = _upload(server, "admin")
    created = client.post("/v1/jobs", json=command_job(package, "--steps", "30"))
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["spec"]["workload"] == "command"
    assert job["spec"]["fault_tolerance"] == "restart"
    final = wait_until_ended(client, job["id"], timeout=180)
    lines = [e["data"] for e in all_events(client, job["id"], "log")]
    text = "\n".join(line[2] for batch in lines for line in batch["lines"])
    assert final["state"] == "succeeded", text
    assert "rank 0 of 2 starts at step 0 (restart 0)" in text
    assert "rank 1 of 2 starts at step 0 (restart 0)" in text
    assert "done at step 30" in text
    steps = [e["data"]["step"] for e in all_events(client, job["id"], "metrics")]
    assert steps[-1] == 30
    state = torch.load(Path(files_dir(server.settings.resolved_checkpoint_dir, "admin", job["id"])) / "state.pt")
    assert state["step"] == 30
    expected = reference(30)
    for name, value in expected.items():
        assert torch.allclose(state["model"][name], value, rtol=0, atol=1e-12), name
