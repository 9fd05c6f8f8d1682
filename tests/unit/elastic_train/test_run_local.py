"""``etrain run-local``: a command job on this machine, as a user runs it (the venv's
console script), its processes real DDP on Gloo over loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from elastic_train.run_local import RunLocalError, environments

ROOT = Path(__file__).resolve().parents[3]
ETRAIN = str(Path(sys.executable).parent / "etrain")
SCRIPT = ROOT / "tests" / "workloads" / "torchrun_script" / "train.py"


def test_each_local_worker_gets_torchruns_variables_for_one_node() -> None:
    envs = environments(2, {"PATH": "/bin"}, "/ck", 29400)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
    ]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", "29400")}
    assert {e["ETRAIN_CHECKPOINT_DIR"] for e in envs} == {"/ck"}
    assert {e["PATH"] for e in envs} == {"/bin"}


def test_a_tensorflow_job_s_local_workers_get_tf_config_each_on_its_own_port() -> None:
    envs = environments(2, {}, "/ck", 29400, framework="tensorflow")
    configs = [json.loads(e["TF_CONFIG"]) for e in envs]
    assert [c["task"] for c in configs] == [
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    (cluster,) = {json.dumps(c["cluster"]) for c in configs}  # the same for both
    hosts = json.loads(cluster)["worker"]
    assert len(hosts) == 2 and len(set(hosts)) == 2
    assert all(h.startswith("127.0.0.1:") for h in hosts)
    assert "TF_CONFIG" not in environments(1, {}, "/ck", 29400)[0]
    with pytest.raises(RunLocalError, match="unknown framework 'horovod'"):
        environments(1, {}, "/ck", 29400, framework="horovod")


def project(tmp_path: Path, *args: str) -> Path:
    shutil.copy(SCRIPT, tmp_path / "train.py")
    spec = {"name": "local", "command": ["python", "train.py", *args]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


def test_a_script_runs_on_two_local_workers_then_resumes_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    root = project(tmp_path, "--steps", "6", "--every", "3")
    done = subprocess.run(
        [ETRAIN, "run-local", "job.yaml", "--workers", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "[rank 0] rank 0 of 2 starts at step 0 (restart 0)" in lines
    assert "[rank 1] rank 1 of 2 starts at step 0 (restart 0)" in lines
    points = [line for line in lines if line.startswith("[metrics] ")]
    assert [p.split()[1] for p in points] == [f"step={s}" for s in range(1, 7)]
    state = torch.load(root / ".etrain-local" / "local" / "state.pt")
    assert state["step"] == 6

    # A longer run from the same directory resumes where the first ended, as a restart would.
    more = subprocess.run(
        [
            ETRAIN,
            "run-local",
            "job.yaml",
            "--workers",
            "1",
            "--set",
            "command=[python, train.py, --steps, '8']",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert more.returncode == 0, more.stdout + more.stderr
    assert "[rank 0] rank 0 of 1 starts at step 6 (restart 0)" in more.stdout.splitlines()


def test_the_first_failed_process_ends_the_others_and_its_status_is_the_runs(
    tmp_path: Path,
) -> None:
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "fails",
                "command": [
                    "python",
                    "-c",
                    "import os, sys, time; r = int(os.environ['RANK']); "
                    "time.sleep(0.5) if r == 1 else time.sleep(600); sys.exit(7)",
                ],
                "stop_grace_s": 1,
            }
        )
    )
    done = subprocess.run(
        [ETRAIN, "run-local", "job.yaml", "--workers", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 7, done.stdout + done.stderr


def test_a_workload_job_is_for_the_service(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "job.yaml")
    done = subprocess.run(
        [ETRAIN, "run-local", example], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: run-local runs your own code: a command (command: [...]) or a loop of the "
        "package (entrypoint: train.py:train_loop); a built-in workload runs on the service"
    )


LOOP_DIR = ROOT / "tests" / "workloads" / "package_loop"


def test_a_package_loop_runs_on_two_local_workers_with_the_clusters_context(
    tmp_path: Path,
) -> None:
    """The same context as on the cluster: its checkpoints, and a second run resuming from
    the latest, end with the model of one uninterrupted process."""
    from tests.integration.test_package_loops import reference

    for name in ("train.py", "points.py"):
        shutil.copy(LOOP_DIR / name, tmp_path / name)

    def run(steps: int) -> list[str]:
        spec = {
            "name": "local",
            "entrypoint": "train.py:train_loop",
            "hyperparameters": {"steps": steps},
            "checkpoint": {"every_steps": 4},
        }
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
        done = subprocess.run(
            [ETRAIN, "run-local", "job.yaml", "--workers", "2"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.splitlines()

    lines = run(8)
    assert "[rank 0] loop: rank 0 of 2, ray loaded: False" in lines
    steps = [line.split()[1] for line in lines if line.startswith("[metrics] step=")]
    assert steps == [f"step={s}" for s in range(1, 9)]
    saved = [line.split()[2] for line in lines if line.startswith("[checkpoint] ")]
    assert saved == ["4:", "8:"]
    lines = run(12)  # from the checkpoint of step 8
    steps = [line.split()[1] for line in lines if line.startswith("[metrics] step=")]
    assert steps == [f"step={s}" for s in range(9, 13)]
    state = torch.load(tmp_path / ".etrain-local" / "local" / "final.pt")
    assert state["step"] == 12
    for name, value in reference(12, tmp_path / "reference").items():
        got = state["model"][name.removeprefix("module.")]
        assert torch.allclose(got, value, rtol=0, atol=1e-12), name
