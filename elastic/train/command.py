"""A command job on one worker: the user's command (``["python", "train.py", ...]``) run
unchanged as a child of the worker, with the environment torchrun gives a worker.

The workers of an attempt keep their own small process group, apart from the one the
command forms: through it they agree, every ``TICK_S``, whether every command has ended,
whether one failed, and whether the job is to stop for a resize. That is torchrun's elastic
contract: on a node loss or a grow every command is stopped, and the next attempt starts
the command again at the new size; the script resumes from its own checkpoint in
``ETRAIN_CHECKPOINT_DIR``. A grow gives it ``stop_grace_s`` between SIGTERM and SIGKILL
to save.

The child holds no Ray connection: it is started through ``confine.py`` with an
environment cut to what Python and torch need (``command_env``), as an unprivileged uid of
its owner when the worker is root, in a PID namespace of its own, which the kernel empties
when the command ends or the worker dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from elastic.events import COMMANDS_STARTED, EventKind
from elastic.train import command_env
from elastic.train.context import PausedForResize, TrainContext
from elastic.train.metric_points import PointMerger
from elastic.train.process_group import AttemptAbandoned, all_reduce

log = logging.getLogger(__name__)

# What a command may read of /etc: what the C library, Python, TLS and name lookups read;
# not the rest (shadow files, the host's keys and service configuration).
ETC_READABLE = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "passwd",
    "group",
    "nsswitch.conf",
    "host.conf",
    "hosts",
    "resolv.conf",
    "gai.conf",
    "services",
    "protocols",
    "mime.types",
    "ssl",
    "ca-certificates",
    "pki",
    "os-release",
    "machine-id",
    "locale.alias",
    "alternatives",
)
# How often the workers agree on how their commands are doing.
TICK_S = 0.25
# How often rank 0 asks the supervisor whether the job stops here to grow.
PAUSE_POLL_S = 1.0
CONFINE = Path(__file__).with_name("confine.py")
_PR_SET_PDEATHSIG = 1
# The stderr lines a failed command's error quotes.
ERROR_LINES = 5


class CommandFailed(RuntimeError):
    """The command exited non-zero on this worker."""


@dataclass(frozen=True)
class CommandPlan:
    """A command job, as its workers get it (``config["command"]``)."""

    argv: list[str]
    job_id: str
    owner: str = ""
    code: str | None = None  # where the job's code package is (a path or a URI)
    files_dir: str | None = None  # the job's own directory, shared by its workers
    stop_grace_s: float = 30.0
    max_restarts: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommandPlan:
        return cls(
            argv=[str(a) for a in d["argv"]],
            job_id=str(d["job_id"]),
            owner=str(d.get("owner") or ""),
            code=d.get("code"),
            files_dir=d.get("files_dir"),
            stop_grace_s=float(d.get("stop_grace_s", 30.0)),
            max_restarts=int(d.get("max_restarts", 0)),
        )


def _die_with_parent() -> None:
    """In the forked child, before exec: the kernel kills it when the worker's thread that
    started it ends, the worker killed or not."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _unpack(location: str, into: Path) -> None:
    """The job's code package (a tar.gz the service checked) into the working directory."""
    if "://" in location:
        from pyarrow import fs

        filesystem, path = fs.FileSystem.from_uri(location)
        # No compression: pyarrow would otherwise unpack a ".gz" name on its own.
        stream_of = filesystem.open_input_stream(path, compression=None)
        with stream_of as stream, tempfile.TemporaryFile() as copy:
            shutil.copyfileobj(stream, copy)
            copy.seek(0)
            with tarfile.open(fileobj=copy, mode="r:gz") as archive:
                archive.extractall(into, filter="data")
        return
    with tarfile.open(location, mode="r:gz") as archive:
        archive.extractall(into, filter="data")


def _give(path: Path, uid: int | None) -> None:
    """``path`` and what is beneath it, to ``uid`` alone."""
    if uid is None:
        return
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), uid, uid)
    os.chown(path, uid, uid)
    path.chmod(0o700)


def _files_dir(plan: CommandPlan, uid: int | None) -> str | None:
    """The job's own shared directory, made on first use: ``<root>/_files/<owner>/<job>``,
    where ``_files`` lets anyone pass and each owner's directory is the owner's uid's."""
    if plan.files_dir is None or "://" in plan.files_dir:
        return plan.files_dir
    job_dir = Path(plan.files_dir)
    owner_dir = job_dir.parent
    owner_dir.parent.mkdir(parents=True, exist_ok=True)
    owner_dir.parent.chmod(0o711)
    root = owner_dir.parent.parent
    if uid is not None and not root.stat().st_mode & 0o001:
        root.chmod(root.stat().st_mode | 0o001)  # passable, not listable
    job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if uid is not None:
        os.chown(owner_dir, uid, uid)
        owner_dir.chmod(0o700)
        os.chown(job_dir, uid, uid)
    return str(job_dir)


def _reachable_by_others(path: str) -> bool:
    """Whether a uid that neither owns nor shares a group with ``path`` and its folders
    can pass through them and read and run it."""
    real = Path(os.path.realpath(path))
    if real.stat().st_mode & 0o005 != 0o005:
        return False
    return all(folder.stat().st_mode & 0o001 for folder in real.parents)


def _unprivileged_uid(owner: str) -> int | None:
    """The uid a root worker runs an owner's command as; None when the worker is not root
    (the command runs as the worker's uid), or when the workers' Python lies where other
    uids cannot reach it (under ``/root``, for one): then it runs as uid 0, with no
    capabilities and within Landlock's bounds, which the job's log says."""
    if os.geteuid() != 0:
        return None
    if not _reachable_by_others(sys.executable):
        print(
            f"[elastic-train] the command runs as uid 0 without capabilities, not as an "
            f"unprivileged uid: this node's Python ({os.path.realpath(sys.executable)}) "
            "cannot be run by other users",
            file=sys.stderr,
            flush=True,
        )
        return None
    return command_env.uid_of(owner)


def readable_roots() -> list[str]:
    """What a command may read besides its own directories: the system's programs and
    libraries, Python's installation (this interpreter's, its packages'), and
    ``elastic_train``'s package (``elastic_train.report``)."""
    # Found, not imported: the client package is not the workers' to load.
    client = importlib.util.find_spec("elastic_train")
    roots = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/proc", "/sys"}
    roots |= {f"/etc/{name}" for name in ETC_READABLE}
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    roots |= {p for p in sysconfig.get_paths().values() if p}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    if client is not None and client.origin:
        roots.add(str(Path(client.origin).parent))
    roots.add(str(Path(os.path.realpath(sys.executable)).parent))
    return sorted(r for r in roots if os.path.exists(r))


def confinement(workdir: Path, files: str | None, uid: int | None) -> dict[str, Any]:
    """``confine.py``'s rules for a command: it writes its working directory, its job's
    own directory and devices (``/dev/shm`` for DataLoader workers), reads what
    :func:`readable_roots` names, and runs as ``uid``."""
    writable = [str(workdir), "/dev", *([files] if files and "://" not in files else [])]
    return {"read": readable_roots(), "write": writable, "uid": uid, "gid": uid}


@dataclass
class _Running:
    """One worker's command, started."""

    process: subprocess.Popen[bytes]
    report_read: int
    stderr_tail: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def exited(self) -> int | None:
        return self.process.poll()

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL once ``grace_s`` has passed."""
        if self.exited() is None and grace_s > 0:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        if self.exited() is None:
            self.signal(signal.SIGKILL)
        self.process.wait()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=5)


def _pump(stream: IO[bytes], out: Callable[[str], None], tail: list[str] | None) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        out(line)
        if tail is not None:
            tail.append(line)
            del tail[:-ERROR_LINES]
    stream.close()


def _relay_reports(read_fd: int, points: PointMerger | None) -> None:
    with os.fdopen(read_fd, "rb") as pipe:
        for raw in pipe:
            if points is not None:
                points.add_line(raw)
    if points is not None:
        points.flush()


def _start(
    argv: list[str],
    workdir: Path,
    env: dict[str, str],
    rules: dict[str, Any],
    points: PointMerger | None,
) -> _Running:
    read_fd, write_fd = os.pipe()
    env = {**env, command_env.REPORT_FD_ENV: str(write_fd)}
    wrapped = [sys.executable, "-I", str(CONFINE), json.dumps(rules), "--", *argv]
    if os.geteuid() == 0 and shutil.which("unshare"):
        # Its own /proc too: the processes of other jobs, and their command lines, are not
        # its to see (Ray finds its cluster from those of its own processes).
        wrapped = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--", *wrapped]
    try:
        process = subprocess.Popen(
            wrapped,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        os.close(write_fd)
    running = _Running(process, read_fd)
    assert process.stdout is not None and process.stderr is not None
    pumps: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (_pump, (process.stdout, lambda s: print(s, file=sys.stdout, flush=True), None)),
        (
            _pump,
            (process.stderr, lambda s: print(s, file=sys.stderr, flush=True), running.stderr_tail),
        ),
    ]
    # Every rank reads its pipe (a closed one would fail a report on other ranks); rank 0's
    # points are the job's.
    pumps.append((_relay_reports, (read_fd, points)))
    for target, args in pumps:
        thread = threading.Thread(target=target, args=args, name="etrain-command-io", daemon=True)
        thread.start()
        running.threads.append(thread)
    return running


@contextlib.contextmanager
def _working_directory(plan: CommandPlan, uid: int | None) -> Iterator[Path]:
    """A fresh directory on this node for one run of the command, its code unpacked in
    it; removed with what the command left there."""
    workdir = Path(tempfile.mkdtemp(prefix=f"etrain-{plan.job_id[:12]}-"))
    try:
        if plan.code:
            _unpack(plan.code, workdir)
        (workdir / ".tmp").mkdir(exist_ok=True)
        _give(workdir, uid)
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_command(config: dict[str, Any], ctx: TrainContext) -> None:
    """The ``train_loop`` of a command job (see the module's docstring)."""
    import ray

    plan = CommandPlan.from_dict(config["command"])
    worker = ctx.worker
    rank, world = ctx.rank, ctx.world_size
    uid = _unprivileged_uid(plan.owner)
    host = ray.util.get_node_ip_address()
    mine = (ray.get_runtime_context().get_node_id(), host, [str(g) for g in ray.get_gpu_ids()])
    everyone: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    master: list[Any] = [host, _free_port(host)] if rank == 0 else [None, None]
    if world > 1:
        dist.broadcast_object_list(master, src=0)
    place = command_env.places([n for n, _, _ in everyone])[rank]
    files = _files_dir(plan, uid)
    added = command_env.torchrun_variables(
        rank,
        world,
        place,
        str(master[0]),
        int(master[1]),
        restart_count=worker.attempt - 1,
        max_restarts=plan.max_restarts,
        run_id=plan.job_id,
    )
    if files is not None:
        added[command_env.CHECKPOINT_DIR_ENV] = files
    gpus = [g for n, _, ids in everyone if n == mine[0] for g in ids]
    if gpus:  # the node's workers' GPUs, in local-rank order: LOCAL_RANK picks this one's
        added["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    with _working_directory(plan, uid) as workdir:
        env = command_env.child_environment(os.environ, str(workdir), added)
        rules = confinement(workdir, files, uid)
        points = PointMerger(lambda point: _send_point(ctx, point)) if rank == 0 else None
        argv = command_env.resolve_argv(plan.argv)
        running = _start(argv, workdir, env, rules, points)
        try:
            if rank == 0:
                # The attempt runs once its commands do: the job shows running.
                ctx.worker.emit(
                    EventKind.METRICS,
                    {
                        "step": worker.completed_step,
                        "world_size": world,
                        "completed_step": worker.completed_step,
                        COMMANDS_STARTED: True,
                    },
                )
            _watch(ctx, plan, running, points)
        finally:
            running.stop(0)
            running.join()


def _send_point(ctx: TrainContext, point: dict[str, Any]) -> None:
    step = int(point["step"])
    ctx.worker.completed_step = max(ctx.worker.completed_step, step)
    ctx.worker.emit(
        EventKind.METRICS,
        {**point, "world_size": ctx.world_size, "completed_step": ctx.worker.completed_step},
    )


def _watch(
    ctx: TrainContext, plan: CommandPlan, running: _Running, points: PointMerger | None
) -> None:
    """Until every worker's command has ended (returns), one failed (raises), or the job
    stops to resize (raises :class:`PausedForResize`)."""
    worker = ctx.worker
    asked_at = time.monotonic()
    pause = False
    while True:
        code = running.exited()
        if ctx.rank == 0 and not pause and time.monotonic() - asked_at >= PAUSE_POLL_S:
            asked_at = time.monotonic()
            pause = worker.drain_noticed() or worker.should_pause(worker.completed_step)
        flags = torch.tensor(
            [code == 0, code not in (None, 0), 1.0 if pause else 0.0], dtype=torch.float64
        )
        if ctx.world_size > 1:
            all_reduce(flags, worker.abandoned)
        done, failed, paused = (int(v) for v in flags.tolist())
        if failed:
            running.stop(0)
            running.join()
            if code not in (None, 0):
                raise CommandFailed(_failure(code, running.stderr_tail))
            raise AttemptAbandoned("the command failed on another worker")
        if paused:
            running.stop(plan.stop_grace_s)
            running.join()
            if points is not None:
                points.flush()
            raise PausedForResize(worker.completed_step)
        if done == ctx.world_size:
            running.join()
            if points is not None:
                points.flush()
            return
        if points is not None:
            points.tick()
        time.sleep(TICK_S)


def _failure(code: int, tail: list[str]) -> str:
    how = f"signal {code - 128}" if code > 128 else f"status {code}"
    last = " | ".join(line.strip() for line in tail if line.strip())
    return f"the command exited with {how}" + (f": {last}" if last else "")
