"""A command's control groups: the files' contents and the kernel's counters as text, and,
where this machine lets a process make groups, the real kernel holding a command run
through ``confine.py`` to its memory and CPUs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.train import command_confinement, command_limits, command_process
from elastic.train.command_env import child_environment
from elastic.train.command_limits import (
    Limits,
    Mount,
    cgroup_mounts,
    cpu_max,
    oom_kills_v1,
    oom_kills_v2,
    own_groups,
    thread_variables,
    v1_parent,
    v1_settings,
    v2_parent,
    v2_settings,
)

# A cgroup v1 "hybrid" node (this project's CI machine) and a cgroup v2 Kubernetes pod.
HYBRID_CGROUP = """9:name=systemd:/
8:pids:/
4:memory:/process_api/76926d608a1943fa11db70856e4cfbfe
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
"""
HYBRID_MOUNTINFO = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
POD_CGROUP = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n"
POD_MOUNTINFO = (
    "1200 1100 0:30 /kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope "
    "/sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw,nsdelegate\n"
    "1201 1100 0:5 / /proc rw - proc proc rw\n"
)
# v1 with cpu and cpuacct mounted together, and the container's group as the mount's root.
COMOUNTED_MOUNTINFO = (
    "50 40 0:40 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
)


def test_a_limit_in_gib_is_whole_pages_of_bytes_and_a_quota_per_period() -> None:
    assert Limits(memory_gib=0.5).memory_bytes == 536_870_912
    assert Limits(memory_gib=1e-9).memory_bytes == 4096
    assert Limits(cpus=2).memory_bytes is None
    assert Limits(cpus=2, memory_gib=1).wanted() == ("memory", "cpu")
    assert Limits(cpus=None, memory_gib=None).wanted() == ()
    assert cpu_max(2) == "200000 100000"
    assert cpu_max(0.5) == "50000 100000"
    assert cpu_max(0.001) == "1000 100000"  # the kernel's least quota


def test_v2_files_limit_memory_without_swap_and_kill_the_command_s_processes_together() -> None:
    limits = Limits(cpus=1.5, memory_gib=2)
    assert v2_settings(limits, frozenset({"memory", "cpu"})) == [
        ("memory.max", "2147483648", True),
        ("memory.swap.max", "0", False),
        ("memory.oom.group", "1", False),
        ("cpu.max", "150000 100000", True),
    ]
    assert v2_settings(Limits(cpus=1.5), frozenset({"cpu"})) == [("cpu.max", "150000 100000", True)]


def test_v1_files_set_memory_before_memory_and_swap_and_the_period_before_the_quota() -> None:
    limits = Limits(cpus=3, memory_gib=0.25)
    assert v1_settings("memory", limits) == [
        ("memory.limit_in_bytes", "268435456", True),
        ("memory.memsw.limit_in_bytes", "268435456", False),
    ]
    assert v1_settings("cpu", limits) == [
        ("cpu.cfs_period_us", "100000", True),
        ("cpu.cfs_quota_us", "300000", True),
    ]
    assert v1_settings("memory", Limits(cpus=3)) == []


def test_oom_kills_are_read_from_the_kernel_s_counters() -> None:
    events = "low 0\nhigh 0\nmax 212\noom 3\noom_kill 2\noom_group_kill 1\n"
    assert oom_kills_v2(events) == 2
    assert oom_kills_v2("low 0\nhigh 0\nmax 9\noom 0\noom_kill 0\n") == 0
    assert oom_kills_v2("") == 0
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n", "57") == 1
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n", "57") == 0
    # Before Linux 4.13 only the limit's hits are counted.
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 0\n", "57") == 1
    assert oom_kills_v1("oom_kill_disable 0\nunder_oom 0\n", "0") == 0


def test_on_a_hybrid_node_the_v1_hierarchies_hold_the_groups_beneath_the_worker_s() -> None:
    groups = own_groups(HYBRID_CGROUP)
    mounts = cgroup_mounts(HYBRID_MOUNTINFO)
    assert groups["memory"] == "/process_api/76926d608a1943fa11db70856e4cfbfe"
    assert groups[""] == "/"
    assert [m.point for m in mounts] == [
        "/sys/fs/cgroup/cpu",
        "/sys/fs/cgroup/cpuacct",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/systemd",
        "/sys/fs/cgroup/unified",
    ]
    assert v1_parent("memory", groups, mounts) == Path(
        "/sys/fs/cgroup/memory/process_api/76926d608a1943fa11db70856e4cfbfe"
    )
    assert v1_parent("cpu", groups, mounts) == Path("/sys/fs/cgroup/cpu")
    # The v2 mount is found; whether it has controllers is the kernel's to say.
    assert v2_parent(groups, mounts) == Path("/sys/fs/cgroup/unified")


def test_in_a_v2_pod_the_group_is_beneath_the_container_s_own() -> None:
    groups = own_groups(POD_CGROUP)
    mounts = cgroup_mounts(POD_MOUNTINFO)
    assert mounts == [
        Mount(
            "/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope",
            "/sys/fs/cgroup",
            "cgroup2",
            frozenset({"rw", "nsdelegate"}),
        )
    ]
    assert v2_parent(groups, mounts) == Path("/sys/fs/cgroup")
    assert v1_parent("memory", groups, mounts) is None


def test_a_comounted_v1_hierarchy_is_found_by_its_controller_and_its_root() -> None:
    mounts = cgroup_mounts(COMOUNTED_MOUNTINFO)
    assert v1_parent("cpu", {"cpu": "/docker/abc/sub"}, mounts) == Path(
        "/sys/fs/cgroup/cpu,cpuacct/sub"
    )
    assert v1_parent("cpu", {"cpu": "/elsewhere"}, mounts) is None
    assert v1_parent("memory", {"memory": "/docker/abc"}, mounts) is None


def test_thread_pools_get_the_job_s_whole_cpus_unless_the_worker_s_environment_says() -> None:
    assert thread_variables(2.5, {}) == {name: "2" for name in command_limits.THREAD_VARIABLES}
    assert thread_variables(0.5, {})["OMP_NUM_THREADS"] == "1"
    assert thread_variables(None, {}) == {}
    env = child_environment({"OMP_NUM_THREADS": "6", "PATH": "/usr/bin"}, "/w", {}, cpus=4)
    assert env["OMP_NUM_THREADS"] == "6"
    assert env["MKL_NUM_THREADS"] == "4"
    assert env["OPENBLAS_NUM_THREADS"] == "4"
    assert "MKL_NUM_THREADS" not in child_environment({}, "/w", {})


# -- the real kernel ---------------------------------------------------------------------


def _groups_here(limits: Limits) -> command_limits.CommandGroups:
    made, why_not = command_limits.make_groups("unit-test", limits)
    if why_not is not None:
        made.remove()
        pytest.skip(f"this machine lets no process here make control groups: {why_not}")
    return made


def _confined(tmp_path: Path, groups: command_limits.CommandGroups, code: str) -> tuple[int, str]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    rules = command_confinement.confinement(work, None, None)
    rules["cgroups"] = groups.procs_files
    argv = [sys.executable, "-I", str(command_process.CONFINE), json.dumps(rules), "--"]
    done = subprocess.run(
        [*argv, sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


def test_a_command_over_its_memory_limit_is_killed_and_the_worker_can_tell(tmp_path: Path) -> None:
    groups = _groups_here(Limits(memory_gib=0.125))
    paths = [g.path for g in groups.groups]
    try:
        code = "b = bytearray(b'x') * (512 << 20); print('survived')"
        status, out = _confined(tmp_path, groups, code)
        assert "survived" not in out
        memory = next(g for g in groups.groups if "memory" in g.controllers)
        if memory.version == 1:  # the OOM killer takes the largest process: the command's
            assert status == 128 + signal.SIGKILL, out
            assert groups.oom_kills() == 1
        else:  # memory.oom.group: every process of the group, confine.py's too
            assert status in (128 + signal.SIGKILL, -signal.SIGKILL), out
            assert groups.oom_kills() >= 1
        assert groups.memory_message() == (
            "the command was killed for exceeding its memory limit of 0.125 GiB "
            "(scaling.memory_per_worker_gb)"
        )
    finally:
        groups.remove()
    assert paths and not any(p.exists() for p in paths)


def test_a_command_within_its_limits_runs_in_its_groups_with_the_job_s_cpu_quota(
    tmp_path: Path,
) -> None:
    groups = _groups_here(Limits(cpus=0.5, memory_gib=0.5))
    try:
        code = """
import pathlib
for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
    _, controllers, path = line.split(":", 2)
    if "cpu" in controllers.split(","):
        g = pathlib.Path("/sys/fs/cgroup/cpu" + path)
        print("v1", (g / "cpu.cfs_quota_us").read_text().strip(),
              (g / "cpu.cfs_period_us").read_text().strip())
    elif controllers == "" and pathlib.Path("/sys/fs/cgroup" + path, "cpu.max").exists():
        print("v2", pathlib.Path("/sys/fs/cgroup" + path, "cpu.max").read_text().strip())
b = bytearray(b"x") * (64 << 20)
print("allocated", len(b) >> 20)
"""
        status, out = _confined(tmp_path, groups, code)
        assert status == 0, out
        cpu = next(g for g in groups.groups if "cpu" in g.controllers)
        expected = "v1 50000 100000" if cpu.version == 1 else "v2 50000 100000"
        assert out.splitlines() == [expected, "allocated 64"]
        assert groups.oom_kills() == 0
        assert groups.memory_message() is None
    finally:
        groups.remove()
