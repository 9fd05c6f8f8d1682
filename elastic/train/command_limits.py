"""A command job's share of its node: the CPUs its spec asks for and, when it names one, a
memory limit, held by a control group the worker makes for the command and removes when
the command ends.

The worker makes the group beneath its own, in each hierarchy that limits a resource:
cgroup v2 where the controllers are there and delegated to the worker's group, else the
v1 hierarchy of that controller (a "hybrid" node mounts both). ``confine.py`` moves itself
into it before it drops its privileges, so every process of the command is in it from its
first instruction. At the limit the kernel's OOM killer picks among the command's
processes only, and the group's counters tell the worker that it did. Where the worker can
make no group (not root, read-only, no controller) the command runs without limits, which
its log says.

The pure parts (paths, file contents, the kernel's counters) are functions of text; the
rest reads and writes ``/sys/fs/cgroup``.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
PAGE = 4096
# The kernel's default CFS period; a quota below 1 ms is refused (v1) or useless.
CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
# Thread pools that size themselves to the node's cores unless told: held to the job's
# CPUs, they do not run more threads than the quota lets run at once.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
CONTROLLERS = ("memory", "cpu")
PREFIX = "etrain-"
# How long removing the group waits for the kernel to reap what was in it.
REMOVE_WAIT_S = 5.0


@dataclass(frozen=True)
class Limits:
    """What one worker's command may use: ``cpus`` (a CPU quota), ``memory_gib``."""

    cpus: float | None = None
    memory_gib: float | None = None

    @property
    def memory_bytes(self) -> int | None:
        """The limit in bytes, whole pages (the kernel rounds down to a page too)."""
        if self.memory_gib is None:
            return None
        return max(PAGE, int(self.memory_gib * GIB) // PAGE * PAGE)

    def wanted(self) -> tuple[str, ...]:
        """The controllers these limits need."""
        return tuple(
            c
            for c, v in (("memory", self.memory_gib), ("cpu", self.cpus))
            if v is not None and v > 0
        )


def gib_text(gib: float) -> str:
    """``0.5``, ``2``, ``1.25``: a limit as a job's spec gives it."""
    return f"{gib:g}"


def quota_us(cpus: float, period_us: int = CFS_PERIOD_US) -> int:
    """Microseconds of CPU time per period that make ``cpus`` CPUs."""
    return max(MIN_QUOTA_US, round(cpus * period_us))


def cpu_max(cpus: float, period_us: int = CFS_PERIOD_US) -> str:
    """cgroup v2's ``cpu.max``: quota and period."""
    return f"{quota_us(cpus, period_us)} {period_us}"


def thread_count(cpus: float) -> int:
    """Threads a pool runs on ``cpus`` CPUs: the whole CPUs, one at least."""
    return max(1, math.floor(cpus))


def thread_variables(cpus: float | None, kept: Mapping[str, str]) -> dict[str, str]:
    """The thread-count variables for ``cpus``, but for those ``kept`` (the environment the
    child keeps) sets already."""
    if cpus is None or cpus <= 0:
        return {}
    count = str(thread_count(cpus))
    return {name: count for name in THREAD_VARIABLES if name not in kept}


def flat_keyed(text: str) -> dict[str, int]:
    """A cgroup file of ``key value`` lines (``memory.events``, ``memory.oom_control``)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value.strip())
    return out


def oom_kills_v2(memory_events: str) -> int:
    """Processes the OOM killer killed in a v2 group (``memory.events``)."""
    return flat_keyed(memory_events).get("oom_kill", 0)


def oom_kills_v1(oom_control: str, failcnt: str) -> int:
    """Processes the OOM killer killed in a v1 group: ``memory.oom_control``'s ``oom_kill``
    (Linux 4.13 on); before it, only that usage hit the limit (``memory.failcnt``), which
    with a killed command is taken for one."""
    counts = flat_keyed(oom_control)
    if "oom_kill" in counts:
        return counts["oom_kill"]
    with contextlib.suppress(ValueError):
        return 1 if int(failcnt.strip() or 0) > 0 else 0
    return 0


def own_groups(proc_self_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup``: each v1 controller's group of this process, and its v2 group
    under the key ``""``."""
    out: dict[str, str] = {}
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for name in controllers.split(","):
            if name:
                out[name] = path
    return out


@dataclass(frozen=True)
class Mount:
    root: str  # the hierarchy's folder this mount shows
    point: str
    fstype: str
    options: frozenset[str]  # the superblock's: a v1 mount's controllers among them


def cgroup_mounts(mountinfo: str) -> list[Mount]:
    """The cgroup file systems of ``/proc/self/mountinfo``."""
    mounts = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        mounts.append(Mount(fields[3], point, tail[0], frozenset(tail[2].split(","))))
    return mounts


def _beneath(mount: Mount, group: str) -> Path | None:
    """Where ``group`` (a path in the hierarchy) is under ``mount``; None when the mount
    does not show it."""
    root = mount.root.rstrip("/")
    if group != root and not group.startswith(root + "/"):
        return None
    return Path(mount.point, group[len(root) :].lstrip("/"))


def v2_parent(groups: Mapping[str, str], mounts: list[Mount]) -> Path | None:
    """This process's v2 group's folder, where a v2 group for its command would go."""
    if "" not in groups:
        return None
    for mount in mounts:
        if mount.fstype == "cgroup2" and (found := _beneath(mount, groups[""])) is not None:
            return found
    return None


def v1_parent(controller: str, groups: Mapping[str, str], mounts: list[Mount]) -> Path | None:
    """This process's group's folder in the v1 hierarchy of ``controller``."""
    if controller not in groups:
        return None
    for mount in mounts:
        if mount.fstype == "cgroup" and controller in mount.options:
            found = _beneath(mount, groups[controller])
            if found is not None:
                return found
    return None


def v2_settings(limits: Limits, controllers: frozenset[str]) -> list[tuple[str, str, bool]]:
    """(file, content, required) a v2 group is given: a required one that cannot be
    written means no limit; the others are refinements a kernel may lack."""
    out: list[tuple[str, str, bool]] = []
    memory = limits.memory_bytes
    if "memory" in controllers and memory is not None:
        out.append(("memory.max", str(memory), True))
        out.append(("memory.swap.max", "0", False))  # over the limit is killed, not swapped
        out.append(("memory.oom.group", "1", False))  # the command's processes die together
    if "cpu" in controllers and limits.cpus:
        out.append(("cpu.max", cpu_max(limits.cpus), True))
    return out


def v1_settings(controller: str, limits: Limits) -> list[tuple[str, str, bool]]:
    """(file, content, required) a v1 group of ``controller`` is given, in order (the
    memory-and-swap limit may not be below the memory limit)."""
    memory = limits.memory_bytes
    if controller == "memory" and memory is not None:
        return [
            ("memory.limit_in_bytes", str(memory), True),
            ("memory.memsw.limit_in_bytes", str(memory), False),
        ]
    if controller == "cpu" and limits.cpus:
        return [
            ("cpu.cfs_period_us", str(CFS_PERIOD_US), True),
            ("cpu.cfs_quota_us", str(quota_us(limits.cpus)), True),
        ]
    return []


# -- the groups on this node -------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One group the command is in: its folder, hierarchy and controllers."""

    path: Path
    version: int
    controllers: frozenset[str]


@dataclass
class CommandGroups:
    """The groups made for one run of a command."""

    limits: Limits
    groups: list[Group] = field(default_factory=list)

    @property
    def procs_files(self) -> list[str]:
        """What ``confine.py`` writes itself into."""
        return [str(g.path / "cgroup.procs") for g in self.groups]

    def oom_kills(self) -> int:
        """Processes of the command the OOM killer killed so far."""
        kills = 0
        for group in self.groups:
            if "memory" not in group.controllers:
                continue
            if group.version == 2:
                kills += oom_kills_v2(_read(group.path / "memory.events"))
            else:
                control = _read(group.path / "memory.oom_control")
                kills += oom_kills_v1(control, _read(group.path / "memory.failcnt"))
        return kills

    def memory_message(self) -> str | None:
        """The failure's words when the command was killed for its memory, else None."""
        if self.limits.memory_gib is None or self.oom_kills() == 0:
            return None
        return (
            "the command was killed for exceeding its memory limit of "
            f"{gib_text(self.limits.memory_gib)} GiB (scaling.memory_per_worker_gb)"
        )

    def remove(self) -> None:
        """End what is left in the groups and remove them."""
        for group in self.groups:
            _remove(group)
        self.groups = []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, content: str) -> None:
    with open(path, "w") as f:
        f.write(content)


def _remove(group: Group) -> None:
    deadline = time.monotonic() + REMOVE_WAIT_S
    while True:
        try:
            group.path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                print(
                    f"[elastic-train] cannot remove the command's control group {group.path}: "
                    f"{e.strerror}",
                    file=sys.stderr,
                    flush=True,
                )
                return
        # The command's PID namespace is gone with it; what lingers (a command run without
        # one) is ended here, so that the group can go.
        kill = group.path / "cgroup.kill"
        if kill.exists():
            with contextlib.suppress(OSError):
                _write(kill, "1")
        else:
            for pid in _read(group.path / "cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)


def _v2_controllers(parent: Path, wanted: tuple[str, ...]) -> frozenset[str]:
    """The ``wanted`` controllers a group made beneath ``parent`` gets: those the parent
    has, enabled for its children when they are not yet (which the kernel refuses while
    the parent holds processes, unless it is the hierarchy's root)."""
    available = set(_read(parent / "cgroup.controllers").split()) & set(wanted)
    enabled = set(_read(parent / "cgroup.subtree_control").split())
    for name in sorted(available - enabled):
        with contextlib.suppress(OSError):
            _write(parent / "cgroup.subtree_control", f"+{name}")
    return frozenset(available & set(_read(parent / "cgroup.subtree_control").split()))


def _make(
    parent: Path, name: str, version: int, controllers: frozenset[str], limits: Limits
) -> Group:
    path = parent / name
    path.mkdir(mode=0o755)
    group = Group(path, version, controllers)
    try:
        if version == 2:
            settings = v2_settings(limits, controllers)
        else:
            settings = [s for c in sorted(controllers) for s in v1_settings(c, limits)]
        for file, content, required in settings:
            try:
                _write(path / file, content)
            except OSError:
                if required:
                    raise
    except BaseException:
        _remove(group)
        raise
    return group


def make_groups(name: str, limits: Limits) -> tuple[CommandGroups, str | None]:
    """The command's groups, made and limited as far as this node lets the worker; and,
    when a limit could not be set, why."""
    made = CommandGroups(limits)
    left = list(limits.wanted())
    if not left:
        return made, None
    groups = own_groups(_read(Path("/proc/self/cgroup")))
    mounts = cgroup_mounts(_read(Path("/proc/self/mountinfo")))
    name = f"{PREFIX}{name}-{secrets.token_hex(4)}"
    why: list[str] = []
    parent = v2_parent(groups, mounts)
    if parent is not None:
        try:
            controllers = _v2_controllers(parent, tuple(left))
            if controllers:
                made.groups.append(_make(parent, name, 2, controllers, limits))
                left = [c for c in left if c not in controllers]
        except OSError as e:
            why.append(f"{e.filename}: {e.strerror}")
    for controller in list(left):
        parent = v1_parent(controller, groups, mounts)
        if parent is None:
            continue
        try:
            made.groups.append(_make(parent, name, 1, frozenset([controller]), limits))
            left.remove(controller)
        except OSError as e:
            why.append(f"{e.filename}: {e.strerror}")
    if not left:
        return made, None
    missing = " and ".join(left)
    return made, why[-1] if why else f"no cgroup hierarchy here the worker may write has {missing}"


@contextlib.contextmanager
def limited(name: str, limits: Limits) -> Iterator[CommandGroups]:
    """The command's groups while it runs, removed after. A limit this node cannot hold is
    said in the job's log, and the command runs without it."""
    made, why_not = make_groups(name, limits)
    if why_not is not None:
        held = {c for g in made.groups for c in g.controllers}
        lacking = ", ".join(
            f"{limits.cpus:g} CPUs" if c == "cpu" else f"{gib_text(limits.memory_gib or 0)} GiB"
            for c in limits.wanted()
            if c not in held
        )
        print(
            f"[elastic-train] the command runs without its limit ({lacking}): {why_not}",
            file=sys.stderr,
            flush=True,
        )
    try:
        yield made
    finally:
        made.remove()
