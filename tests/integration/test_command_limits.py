"""A command job held to its share of the node, on a real Ray cluster through the real
service: over its memory limit the kernel kills its command, not the worker or another
job, and the job fails saying so; its command runs with the job's CPU quota."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from elastic.train import command_limits
from elastic_train import Client
from jobs.launcher import files_dir
from tests.conftest import TOKEN, LiveServer, all_events, state_address, wait_for
from tests.integration.test_command_jobs import ended, log_text

HOG = """
import os
print("threads", os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"), flush=True)
hog = bytearray(b"x") * (3 << 29)  # 1.5 GiB, every page written
print("survived", len(hog), flush=True)
"""

# Prints the CPU quota of its own group, then waits until the test lets it end: it runs
# through the other job's kill.
BYSTANDER = """
import os, pathlib, time
for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
    _, controllers, path = line.split(":", 2)
    if "cpu" in controllers.split(","):
        group = pathlib.Path("/sys/fs/cgroup/cpu" + path)
        quota = (group / "cpu.cfs_quota_us").read_text().strip()
        period = (group / "cpu.cfs_period_us").read_text().strip()
        print("quota v1", quota, period, flush=True)
    elif controllers == "" and pathlib.Path("/sys/fs/cgroup" + path, "cpu.max").exists():
        print("quota v2", pathlib.Path("/sys/fs/cgroup" + path, "cpu.max").read_text().strip())
print("threads", os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"), flush=True)
go = pathlib.Path(os.environ["ETRAIN_CHECKPOINT_DIR"], "go")
deadline = time.monotonic() + 240
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.2)
print("bystander done", go.exists(), flush=True)
"""


def _package(root: Path, name: str, script: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "main.py").write_text(textwrap.dedent(script))
    return folder


def _raylets() -> list[int]:
    """The raylets of this test's cluster: the other pytest worker's clusters start and stop
    nodes of their own meanwhile, so only those on this cluster's GCS count."""
    found = subprocess.run(
        ["pgrep", "-f", f"raylet .*--gcs-address={state_address()}"],
        capture_output=True,
        text=True,
    )
    return sorted(int(pid) for pid in found.stdout.split())


def _groups_left() -> list[str]:
    """The command groups on this machine (none once every job's command ended)."""
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-maxdepth", "6", "-type", "d", "-name", "etrain-*"],
        capture_output=True,
        text=True,
    )
    return sorted(found.stdout.split())


def test_a_command_over_its_memory_limit_fails_alone_and_says_why(
    server: LiveServer, tmp_path: Path
) -> None:
    made, why_not = command_limits.make_groups("probe", command_limits.Limits(memory_gib=0.5))
    made.remove()
    if why_not is not None:
        pytest.skip(f"this machine lets the workers make no memory cgroup: {why_not}")
    api = server.client()
    raylets = _raylets()
    groups_before = _groups_left()
    with Client(server.url, TOKEN) as client:
        bystander = client.submit(
            {
                "name": "bystander",
                "command": ["python", "main.py"],
                "scaling": {"cpus_per_worker": 1},
                "failure": {"max_restarts": 0},
            },
            code=_package(tmp_path, "bystander", BYSTANDER),
        )
        wait_for(
            lambda: "threads " in log_text(api, bystander.id), 120, what="the bystander running"
        )
        hog = client.submit(
            {
                "name": "hog",
                "command": ["python", "main.py"],
                "scaling": {"cpus_per_worker": 1, "memory_per_worker_gb": 0.5},
                "failure": {"max_restarts": 1},
            },
            code=_package(tmp_path, "hog", HOG),
        )
        final = ended(api, hog.id, timeout=240)
    text = log_text(api, hog.id)
    message = (
        "the command was killed for exceeding its memory limit of 0.5 GiB "
        "(scaling.memory_per_worker_gb)"
    )
    assert final["state"] == "failed", text
    assert message in final["message"], final
    # Retried as any error is, within max_restarts: each attempt was killed the same way by
    # its worker's kernel, and the worker lived to say so.
    assert final["restarts"] == 1
    assert text.count("threads 1 1") == 2, text
    assert "survived" not in text
    assert text.count(f"CommandFailed: {message}") == 2, text
    kinds = {e["kind"] for e in all_events(api, hog.id)}
    assert "worker_lost" not in kinds, kinds
    # Every raylet of before is alive: the kernel killed the command, not a node.
    assert set(raylets) <= set(_raylets())

    # The other job ran through it, with its one CPU's quota, and ends well.
    server_root = server.settings.resolved_checkpoint_dir
    go = Path(files_dir(server_root, "admin", bystander.id)) / "go"
    go.write_text("")
    done = ended(api, bystander.id, timeout=120)
    other = log_text(api, bystander.id)
    assert done["state"] == "succeeded", other
    assert "bystander done True" in other
    quota = next(line for line in other.splitlines() if line.startswith("quota "))
    assert quota in ("quota v1 100000 100000", "quota v2 100000 100000"), quota
    assert "threads 1 1" in other
    assert all(e["kind"] != "worker_lost" for e in all_events(api, bystander.id))
    # Every group made for the two commands went with them.
    wait_for(lambda: _groups_left() == groups_before, 10, what="the commands' groups removed")
