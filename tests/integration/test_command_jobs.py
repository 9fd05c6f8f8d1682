"""Command jobs: a user's script, unchanged, uploaded with the job and run by every worker
with torchrun's environment, on a real Ray cluster through the real service."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from elastic.train import command_confinement, command_env, command_requirements
from elastic_train import Client
from jobs.launcher import files_dir
from tests.conftest import (
    TOKEN,
    ClusterPool,
    LiveServer,
    all_events,
    create_user_token,
    make_settings,
    small_job,
    state_address,
    wait_for,
    wait_until_ended,
)

WORKLOADS = Path(__file__).parents[1] / "workloads"
SCRIPT_DIR = WORKLOADS / "torchrun_script"
PROBE_DIR = WORKLOADS / "hostile_script"


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


def command_job(*args: str, workers: int = 2) -> dict[str, Any]:
    return {
        "name": "script",
        "command": ["python", "train.py", *args],
        "scaling": {"min_workers": 1, "max_workers": workers, "cpus_per_worker": 1},
        "failure": {"max_restarts": 3, "min_workers_grace_s": 60},
    }


def log_text(api: httpx.Client, job_id: str) -> str:
    batches = [e["data"]["lines"] for e in all_events(api, job_id, "log")]
    return "\n".join(line[2] for lines in batches for line in lines)


def ended(api: httpx.Client, job_id: str, timeout: float) -> dict[str, Any]:
    """The job's last view once it ended; its log and events in the error when it did not."""
    try:
        return wait_until_ended(api, job_id, timeout=timeout)
    except AssertionError as e:
        kinds = [(ev["kind"], ev["data"]) for ev in all_events(api, job_id) if ev["kind"] != "log"]
        raise AssertionError(f"{e}\nevents: {kinds}\nlog:\n{log_text(api, job_id)}") from None


def own_state(server: LiveServer, owner: str, job_id: str) -> dict[str, Any]:
    """What the script saved in its ETRAIN_CHECKPOINT_DIR."""
    root = server.settings.resolved_checkpoint_dir
    return torch.load(Path(files_dir(root, owner, job_id)) / "state.pt")  # type: ignore[no-any-return]


def assert_exact(state: dict[str, Any], steps: int) -> None:
    assert state["step"] == steps
    for name, value in reference(steps).items():
        assert torch.allclose(state["model"][name], value, rtol=0, atol=1e-12), name


def test_a_torchrun_script_runs_unchanged_on_two_workers(server: LiveServer) -> None:
    api = server.client()
    with Client(server.url, TOKEN) as client:
        job = client.submit(command_job("--steps", "30"), code=SCRIPT_DIR)
    info = api.get(f"/v1/jobs/{job.id}").json()
    assert info["spec"]["workload"] == "command"
    assert info["spec"]["fault_tolerance"] == "restart"
    final = wait_until_ended(api, job.id, timeout=180)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    assert "rank 0 of 2 starts at step 0 (restart 0)" in text
    assert "rank 1 of 2 starts at step 0 (restart 0)" in text
    assert "done at step 30" in text
    points = [e["data"] for e in all_events(api, job.id, "metrics")]
    assert [p["step"] for p in points if "loss" in p] == list(range(1, 31))
    assert final["step"] == 30
    assert_exact(own_state(server, "admin", job.id), 30)


def test_a_torchrun_script_survives_a_node_loss_and_grows_back_from_its_own_checkpoint(
    server: LiveServer, ray_cluster: ClusterPool
) -> None:
    """Torchrun's elastic contract: a node lost, every process stops and the script starts
    again at 2 from its own checkpoint; the node back, it is stopped (SIGTERM) and starts at
    3. The model at the end is the uninterrupted run's."""
    api = server.client()
    steps = 120
    with Client(server.url, TOKEN) as client:
        spec = command_job("--steps", str(steps), "--every", "5", "--pace", "0.15", workers=3)
        job = client.submit(spec, code=SCRIPT_DIR)

    def view() -> dict[str, Any]:
        return api.get(f"/v1/jobs/{job.id}").json()  # type: ignore[no-any-return]

    wait_for(lambda: (j := view())["step"] >= 12 and j["world_size"] == 3, 120, what="step 12 at 3")
    ray_cluster.kill_node(ray_cluster.pool[1])

    def trained_at_2() -> bool:
        # A point the script reported at 2 workers (the job's view may still show the
        # first attempt's last steps beside the second attempt's size).
        points = all_events(api, job.id, "metrics")
        return any(p["data"]["world_size"] == 2 and "loss" in p["data"] for p in points)

    wait_for(trained_at_2, 120, what="training at 2")
    ray_cluster.add_node()
    final = ended(api, job.id, timeout=240)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    assert final["restarts"] == 1
    starts = [line for line in text.splitlines() if line.startswith("rank 0 of ")]
    worlds = [line.split(" of ")[1].split(" ")[0] for line in starts]
    assert worlds == ["3", "2", "3"], starts
    resumed = [int(line.split("at step ")[1].split(" ")[0]) for line in starts]
    assert resumed[0] == 0 and 10 <= resumed[1] <= resumed[2], starts
    assert all(step % 5 == 0 for step in resumed), starts
    assert [line.rsplit("(", 1)[1] for line in starts] == ["restart 0)", "restart 1)", "restart 2)"]
    assert f"done at step {steps}" in text
    assert final["step"] == steps
    assert_exact(own_state(server, "admin", job.id), steps)


def _raylet_pid() -> int:
    """The head raylet of this test's cluster, the oldest one on its GCS: a raylet of any
    cluster would do for the probe, but the other pytest worker's come and go."""
    found = subprocess.run(
        ["pgrep", "-o", "-f", f"raylet .*--gcs-address={state_address()}"],
        capture_output=True,
        text=True,
    )
    return int(found.stdout.split()[0])


@pytest.mark.parametrize("style", ["command", "loop"])
def test_a_users_code_cannot_reach_what_is_not_its_own(
    server: LiveServer, tmp_path: Path, style: str
) -> None:
    """A hostile job's code tries each thing it must not do; another user's job trains on.
    The same tries run as a command and as a package's ``train_loop``."""
    admin = server.client()
    bob = server.client(token=create_user_token(admin, "bob"))
    other = bob.post("/v1/jobs", json={**small_job(max_steps=60), "name": "bystander"})
    assert other.status_code == 201, other.text
    root = Path(server.settings.resolved_checkpoint_dir)
    # Another user's files, and another job's checkpoint, where the command could look.
    others = Path(files_dir(str(root), "bob", other.json()["id"]))
    others.mkdir(parents=True, exist_ok=True)
    (others / "secret").write_text("bob's")
    checkpoint = root / other.json()["id"] / "secret"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_text("bob's checkpoint")
    database = server.settings.data_dir / "etrain.db"
    ray_session = "/tmp/ray/session_latest/session.json"
    secrets = [str(others / "secret"), str(checkpoint), str(database), ray_session, "/etc/shadow"]
    marker = f"{600 + os.getpid() % 1000}.{int(time.time()) % 1000}"
    raylet = _raylet_pid()
    args = [",".join(secrets), str(tmp_path), str(raylet), marker]
    spec: dict[str, Any] = {"name": "probe", "failure": {"max_restarts": 0}}
    if style == "command":
        spec["command"] = ["python", "probe.py", *args]
    else:
        spec |= {"entrypoint": "probe.py:train_loop", "hyperparameters": {"args": args}}
    with Client(server.url, create_user_token(admin, "mallory")) as mallory:
        job = mallory.submit(spec, code=PROBE_DIR)
    final = ended(admin, job.id, timeout=120)
    text = log_text(admin, job.id)
    assert final["state"] == "succeeded", text
    probe = json.loads(next(line for line in text.splitlines() if line.startswith("PROBE "))[6:])
    reachable = command_confinement.reachable_by_others(sys.executable)
    expected_uid = command_env.uid_of("mallory") if reachable else 0
    assert probe["uid"] == expected_uid
    assert probe["cap_eff"] == "0000000000000000"
    assert probe["env"] == sorted(
        ["ETRAIN_CHECKPOINT_DIR", "ETRAIN_REPORT_FD"]
        + (["ETRAIN_REPLY_FD"] if style == "loop" else [])
    )
    assert all(got.startswith("refused") for got in probe["read"].values()), probe["read"]
    assert all(got.startswith("refused") for got in probe["list"].values()), probe["list"]
    assert probe["write"].startswith("refused") and not (tmp_path / "planted").exists()
    assert probe["write_own"] == "got: '1'"
    assert probe["signal"].startswith("refused")
    assert probe["ray"].startswith("refused"), probe["ray"]
    # Nothing of the command's outlives its job.
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
    assert wait_until_ended(bob, other.json()["id"])["state"] == "succeeded"
    os.kill(raylet, 0)  # the raylet the probe tried to signal runs on


def test_a_command_reads_its_owners_data_roots_and_no_one_elses(
    ray_cluster: ClusterPool, tmp_path: Path
) -> None:
    users = tmp_path / "users"
    for name in ("alice", "bob"):
        (users / name).mkdir(parents=True)
        (users / name / "data.txt").write_text(f"{name}'s data")
    settings = make_settings(tmp_path / "svc", data_roots=[str(users / "{user}")])
    with LiveServer(settings) as live:
        admin = live.client()
        alice = live.client(token=create_user_token(admin, "alice"))
        read = "import sys; print('READ', open(sys.argv[1]).read())"
        outcomes = {}
        for whose in ("alice", "bob"):
            spec = {
                "name": f"reads-{whose}",
                "command": ["python", "-c", read, str(users / whose / "data.txt")],
                "failure": {"max_restarts": 0},
            }
            created = alice.post("/v1/jobs", json=spec)
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            outcomes[whose] = (ended(admin, job_id, timeout=120), log_text(admin, job_id))
    assert outcomes["alice"][0]["state"] == "succeeded", outcomes["alice"][1]
    assert "READ alice's data" in outcomes["alice"][1]
    assert outcomes["bob"][0]["state"] == "failed"
    assert "PermissionError" in outcomes["bob"][1]
    assert "READ" not in outcomes["bob"][1]


def test_a_command_job_s_requirements_are_installed_once_per_node_for_it(
    server: LiveServer, tmp_path: Path
) -> None:
    """A real pip install from the package index, confined as the command is, on the
    command's PYTHONPATH; the next job of the owner finds it installed; a requirement pip
    cannot meet fails the job with pip's words."""
    api = server.client()
    # An install an earlier run left on this machine would be found: this run installs.
    key = command_requirements.install_key("admin", ["pyjokes==0.8.3"], tmp_path)
    shutil.rmtree(command_requirements.DEPS_ROOT / key, ignore_errors=True)
    where = "import pyjokes; print('FROM', pyjokes.__file__)"
    spec = {
        "name": "needs-a-package",
        "command": ["python", "-c", where],
        "requirements": ["pyjokes==0.8.3"],
        "failure": {"max_restarts": 0},
    }
    texts = []
    for _ in range(2):
        created = api.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        final = ended(api, created.json()["id"], timeout=240)
        texts.append(log_text(api, created.json()["id"]))
        assert final["state"] == "succeeded", texts[-1]
    first, second = texts
    assert "[elastic-train] installing the requirements: pip install pyjokes==0.8.3" in first
    assert "[elastic-train] requirements installed in " in first
    assert "[elastic-train] requirements: installed on this node already" in second
    for text in texts:
        path = next(line for line in text.splitlines() if line.startswith("FROM "))[5:]
        assert path.startswith("/tmp/etrain-deps/") and path.endswith("pyjokes/__init__.py")

    broken = api.post("/v1/jobs", json={**spec, "requirements": ["pyjokes==999.0.0"]})
    final = ended(api, broken.json()["id"], timeout=240)
    assert final["state"] == "failed"
    assert "installing the requirements failed (pip exited with 1)" in final["message"], final
