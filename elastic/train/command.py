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
import json
import logging
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.storage import is_object_uri
from elastic.events import COMMANDS_STARTED, EventKind
from elastic.train import command_env, command_limits, command_requirements
from elastic.train.child_boot import child_argv
from elastic.train.command_confinement import (
    confinement,
    unprivileged_uid,
    writing_checkpoints,
)
from elastic.train.command_process import Running, free_port, start
from elastic.train.context import PausedForResize, TrainContext
from elastic.train.entrypoint import EntrypointError
from elastic.train.loop_link import ChildRelay, child_config
from elastic.train.metric_points import PointMerger
from elastic.train.process_group import AttemptAbandoned, all_reduce

log = logging.getLogger(__name__)

# How often the workers agree on how their commands are doing.
TICK_S = 0.25
# How often a worker says it is still installing the job's requirements.
INSTALL_NOTICE_S = 15.0
# How often rank 0 asks the supervisor whether the job stops here to grow.
PAUSE_POLL_S = 1.0
# How often a worker looks whether its loop's child ended: a failed child is a failed
# attempt, and restart mode's recovery is timed from the failure.
LOOP_POLL_S = 0.02
# How long a loop's child waits for its peers to form the process group: an attempt given
# up meanwhile ends it sooner (its worker kills it).
LOOP_GROUP_TIMEOUT_S = 300.0


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
    data_roots: tuple[str, ...] = ()  # what the owner's code may read besides its own
    requirements: tuple[str, ...] = ()  # pip's, besides the package's requirements.txt
    # A ``train_loop`` of the package (``train.py:train_loop``) run with the ctx API in the
    # child, instead of ``argv`` (elastic/train/loop_child.py).
    entrypoint: str | None = None
    cpus: float | None = None  # the CPU quota of each worker's command
    memory_gb: float | None = None  # its memory limit, GiB (None: none)
    framework: str = command_env.PYTORCH  # whose variables it gets besides torchrun's

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
            data_roots=tuple(str(r) for r in d.get("data_roots") or ()),
            requirements=tuple(str(r) for r in d.get("requirements") or ()),
            entrypoint=d.get("entrypoint"),
            cpus=d.get("cpus"),
            memory_gb=d.get("memory_gb"),
            framework=str(d.get("framework") or command_env.PYTORCH),
        )


def _unpack(location: str, into: Path) -> None:
    """The job's code package (a tar.gz the service checked) into the working directory."""
    if is_object_uri(location):
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
    if plan.files_dir is None or is_object_uri(plan.files_dir):
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
    uid = unprivileged_uid(plan.owner)
    host = ray.util.get_node_ip_address()
    mine = (ray.get_runtime_context().get_node_id(), host, [str(g) for g in ray.get_gpu_ids()])
    everyone: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    master: list[Any] = [host, free_port(host)] if rank == 0 else [None, None]
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
    endpoints: list[Any] = []
    if plan.framework in command_env.NEEDS_ENDPOINTS:
        # Each worker listens on a port of its own host (TensorFlow's gRPC server): it picks
        # one free there, and every worker is told every worker's, in rank order.
        own = (host, free_port(host))
        endpoints = [own] * world
        if world > 1:
            dist.all_gather_object(endpoints, own)
    added.update(command_env.framework_variables(plan.framework, rank, endpoints))
    if files is not None:
        added[command_env.CHECKPOINT_DIR_ENV] = files
    gpus = [g for n, _, ids in everyone if n == mine[0] for g in ids]
    if gpus:  # the node's workers' GPUs, in local-rank order: LOCAL_RANK picks this one's
        added["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    with _working_directory(plan, uid) as workdir, _limited(plan, rank) as groups:
        env = command_env.child_environment(os.environ, str(workdir), added, plan.cpus)
        rules = confinement(workdir, files, uid, plan.data_roots)
        rules["cgroups"] = groups.procs_files
        args = command_requirements.pip_arguments(plan.requirements, workdir)
        if args:
            installed = _install(ctx, plan, args, workdir, env, rules, uid)
            env["PYTHONPATH"] = str(installed)
            rules["read"].append(str(installed))
        if plan.entrypoint is not None:
            _run_loop(ctx, config, plan, workdir, env, rules, uid, host)
            return
        points = PointMerger(lambda point: _send_point(ctx, point)) if rank == 0 else None
        argv = command_env.resolve_argv(plan.argv)
        running = start(argv, workdir, env, rules, points)
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


@contextlib.contextmanager
def _limited(plan: CommandPlan, rank: int) -> Iterator[command_limits.CommandGroups]:
    """The control groups that hold the command to its CPUs and memory while it runs; a
    command the kernel killed at its memory limit fails saying so."""
    limits = command_limits.Limits(plan.cpus, plan.memory_gb)
    with command_limits.limited(f"{plan.job_id[:12]}-{rank}", limits) as groups:
        try:
            yield groups
        except CommandFailed as e:
            memory = groups.memory_message()
            if memory is None:
                raise
            raise CommandFailed(memory) from e


def _run_loop(
    ctx: TrainContext,
    config: dict[str, Any],
    plan: CommandPlan,
    workdir: Path,
    env: dict[str, str],
    rules: dict[str, Any],
    uid: int | None,
    host: str,
) -> None:
    """The package's ``train_loop`` in the child (``elastic/train/loop_child.py``), this
    worker its line to the supervisor, until the child exits: 0 when the loop ended or
    paused for a resize, :data:`CODE_ERROR_EXIT` when the entrypoint cannot load."""
    assert plan.entrypoint is not None
    worker = ctx.worker
    rules = writing_checkpoints(rules, worker.config.checkpoint_dir, uid)
    loop_config = child_config(config)
    plan_file = workdir / ".tmp" / "loop-plan.json"
    plan_file.write_text(
        json.dumps(
            {
                "entrypoint": plan.entrypoint,
                "config": loop_config,
                "timeout_s": LOOP_GROUP_TIMEOUT_S,
                "node_address": host,
            }
        )
    )
    _give(plan_file, uid)
    points = PointMerger(lambda point: _send_point(ctx, point)) if ctx.rank == 0 else None
    relay = ChildRelay(worker, points.add_line if points is not None else None)
    argv = child_argv("elastic.train.loop_child", str(plan_file))
    running = start(argv, workdir, env, rules, None, on_line=relay.line, replies=True)
    assert running.replies is not None
    relay.attach(running.replies)
    told_drain = False
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = running.process.wait(timeout=LOOP_POLL_S)
                break
            if worker.abandoned.is_set():
                raise AttemptAbandoned("the attempt failed elsewhere")
            if ctx.rank == 0 and not told_drain and worker.drain_noticed():
                relay.tell_drain()
                told_drain = True
    finally:
        running.stop(0)
        running.join()
    if points is not None:
        points.flush()
    if relay.code_error is not None:
        raise EntrypointError(relay.code_error)
    if code != 0:
        raise CommandFailed(_failure(code, running.stderr_tail))


def _install(
    ctx: TrainContext,
    plan: CommandPlan,
    args: list[str],
    workdir: Path,
    env: dict[str, str],
    rules: dict[str, Any],
    uid: int | None,
) -> Path:
    """The job's requirements installed on this node (once per owner and requirements);
    every worker waits for the others' installs, saying so while they last."""
    key = command_requirements.install_key(plan.owner, args, workdir)
    final = command_requirements.DEPS_ROOT / key
    running: Running | None = None
    stage = final
    if final.is_dir():
        print("[elastic-train] requirements: installed on this node already", flush=True)
    else:
        stage, final = command_requirements.staging(key, uid)
        print(f"[elastic-train] installing the requirements: pip install {shlex.join(args)}")
        pip_rules = {**rules, "write": [*rules["write"], str(stage)]}
        argv = command_requirements.pip_command(stage, args)
        running = start(argv, workdir, env, pip_rules, None)
    began = told = time.monotonic()
    try:
        while True:
            code = None if running is None else running.exited()
            done, failed, _ = _agree(ctx, 0 if running is None else code)
            if failed:
                if code not in (None, 0):
                    assert running is not None
                    running.join()
                    raise CommandFailed(
                        f"installing the requirements failed (pip exited with {code}): "
                        + " | ".join(running.stderr_tail)
                    )
                raise AttemptAbandoned("installing the requirements failed on another worker")
            if done == ctx.world_size:
                break
            if time.monotonic() - told >= INSTALL_NOTICE_S:
                told = time.monotonic()
                print(
                    f"[elastic-train] still installing the requirements ({told - began:.0f} s)",
                    flush=True,
                )
            time.sleep(TICK_S)
    finally:
        if running is not None:
            running.stop(0)
            running.join()
    if running is not None:
        command_requirements.publish(stage, final)
        print(f"[elastic-train] requirements installed in {time.monotonic() - began:.1f} s")
    return final


def _agree(ctx: TrainContext, code: int | None, pause: bool = False) -> tuple[int, int, int]:
    """Across the workers: how many commands ended well, how many failed, whether one
    asked to pause (``code``: this worker's command's status, None while it runs)."""
    flags = torch.tensor(
        [code == 0, code not in (None, 0), 1.0 if pause else 0.0], dtype=torch.float64
    )
    if ctx.world_size > 1:
        all_reduce(flags, ctx.worker.abandoned)
    done, failed, paused = (int(v) for v in flags.tolist())
    return done, failed, paused


def _send_point(ctx: TrainContext, point: dict[str, Any]) -> None:
    step = int(point["step"])
    ctx.worker.completed_step = max(ctx.worker.completed_step, step)
    ctx.worker.emit(
        EventKind.METRICS,
        {**point, "world_size": ctx.world_size, "completed_step": ctx.worker.completed_step},
    )


def _watch(
    ctx: TrainContext, plan: CommandPlan, running: Running, points: PointMerger | None
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
        done, failed, paused = _agree(ctx, code, pause)
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
