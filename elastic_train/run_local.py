"""``etrain run-local job.yaml --code DIR --workers N``: a job of the user's own code on
this machine, with no service and no Ray, as the cluster runs it: N processes, each with the
environment torchrun gives a worker and the job's ``ETRAIN_CHECKPOINT_DIR``; rank 0's
metrics are printed. A quick test before submitting.

A command job runs its command. A loop of the package (``entrypoint: train.py:train_loop``)
runs with the same context as on the cluster (``elastic/train/loop_child.py``): the same
data order, global batch and checkpoints, kept under ``.etrain-local`` so that a second run
resumes from the latest one, as a restart would.

Like torchrun, the first process to fail ends the others (SIGTERM, then SIGKILL after the
spec's ``stop_grace_s``); its status is the run's."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from elastic.train import command_env
from elastic.train.command_process import free_port, stop_group

# Where a local run's ETRAIN_CHECKPOINT_DIR goes, under the code's directory (kept: a
# second run resumes from it, as a restart would).
LOCAL_DIR = ".etrain-local"
POLL_S = 0.1
# How long a local loop's processes wait for each other to form their group.
LOCAL_GROUP_TIMEOUT_S = 120.0


class RunLocalError(ValueError):
    """A job that run-local cannot run; the message says why."""


def environments(
    workers: int,
    base: Mapping[str, str],
    checkpoint_dir: str,
    port: int,
    framework: str = command_env.PYTORCH,
) -> list[dict[str, str]]:
    """Each local worker's environment: ``base`` with torchrun's variables for one node,
    and what ``framework``'s launcher adds (TensorFlow's ``TF_CONFIG``, each worker on a
    port of its own)."""
    if framework not in command_env.FRAMEWORKS:
        raise RunLocalError(
            f"unknown framework {framework!r}: one of {', '.join(command_env.FRAMEWORKS)}"
        )
    places = command_env.places(["local"] * workers)
    own_ports = [] if framework == command_env.PYTORCH else free_ports(workers)
    endpoints = [("127.0.0.1", p) for p in own_ports]
    return [
        {
            **base,
            **command_env.torchrun_variables(
                rank,
                workers,
                places[rank],
                "127.0.0.1",
                port,
                restart_count=0,
                max_restarts=0,
                run_id="local",
            ),
            **command_env.framework_variables(framework, rank, endpoints),
            command_env.CHECKPOINT_DIR_ENV: checkpoint_dir,
        }
        for rank in range(workers)
    ]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on loopback now."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port("127.0.0.1"))
    return sorted(ports)


def _pump(stream: IO[bytes], prefix: str, out: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        out(f"{prefix}{raw.decode(errors='replace').rstrip()}")
    stream.close()


def _points(read_fd: int, out: Callable[[str], None]) -> None:
    with os.fdopen(read_fd, "rb") as pipe:
        for raw in pipe:
            with contextlib.suppress(ValueError):
                point = json.loads(raw)
                out("[metrics] " + " ".join(f"{k}={v}" for k, v in point.items()))


def _loop_lines(read_fd: int, replies: IO[bytes], out: Callable[[str], None]) -> None:
    """A loop's line to its worker, answered as a worker alone would: never pause (nothing
    grows here); its metrics and checkpoints printed."""
    with os.fdopen(read_fd, "rb") as pipe, replies:
        for raw in pipe:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            if message.get("ask") == "pause":
                with contextlib.suppress(OSError, ValueError):
                    replies.write(b'{"pause": false}\n')
                    replies.flush()
            elif "emit" in message:
                data = message.get("data") or {}
                if message["emit"] == "metrics":
                    out("[metrics] " + " ".join(f"{k}={v}" for k, v in data.items()))
                elif message["emit"] == "checkpoint_saved":
                    out(f"[checkpoint] step {data.get('step')}: {data.get('path')}")
            elif "code_error" in message:
                out(f"[error] {message['code_error']}")
            else:
                out("[metrics] " + " ".join(f"{k}={v}" for k, v in message.items()))


def own_program(spec: Mapping[str, Any]) -> tuple[Sequence[str] | None, str | None]:
    """The spec's command, or its package's loop (``module:function``); a built-in
    workload is refused (:class:`RunLocalError`)."""
    command: Sequence[str] | None = spec.get("command")
    loop = spec.get("entrypoint") or (spec.get("workload") if not command else None)
    if not command and not (isinstance(loop, str) and ":" in loop):
        raise RunLocalError(
            "run-local runs your own code: a command (command: [...]) or a loop of the "
            "package (entrypoint: train.py:train_loop); a built-in workload runs on the service"
        )
    return command, loop if not command else None


def loop_plan(spec: Mapping[str, Any], job_dir: Path) -> dict[str, Any]:
    """What ``elastic.train.loop_child`` is given for a local run of the spec's loop: the
    config a worker gets on the cluster, its checkpoints in ``job_dir``."""
    from jobs.spec import JobSpec

    # The package is this directory, not an upload: any id stands for it in the check.
    job = JobSpec.model_validate({**spec, "code": spec.get("code") or "0" * 64})
    return {
        "entrypoint": job.workload,
        "config": {
            **job.train_config(),
            "_elastic": {
                "checkpoint_dir": str(job_dir / "checkpoints"),
                "every_steps": job.checkpoint.every_steps,
                "keep": job.checkpoint.keep,
                "max_workers": job.scaling.max_workers,
            },
        },
        "timeout_s": LOCAL_GROUP_TIMEOUT_S,
        "node_address": "127.0.0.1",
        "resume_latest": True,
    }


def run_local(
    spec: Mapping[str, Any],
    code_dir: str | os.PathLike[str],
    workers: int,
    out: Callable[[str], None] = print,
) -> int:
    """Run the job ``spec`` (a command, or a loop of the package) from ``code_dir`` with
    ``workers`` processes; returns the first failed process's status, or 0."""
    command, loop = own_program(spec)
    if workers < 1:
        raise RunLocalError(f"--workers must be at least 1, not {workers}")
    grace = float(spec.get("stop_grace_s", 30.0))
    root = Path(code_dir).resolve()
    checkpoint_dir = root / LOCAL_DIR / str(spec.get("name") or "job")
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if command:
        argv = command_env.resolve_argv(list(command))
        what = shlex.join(argv)
    else:
        plan = loop_plan(spec, checkpoint_dir)
        plan_file = checkpoint_dir / "loop-plan.json"
        plan_file.write_text(json.dumps(plan))
        argv = [sys.executable, "-m", "elastic.train.loop_child", str(plan_file)]
        what = f"{loop} (checkpoints in {plan['config']['_elastic']['checkpoint_dir']})"
    if spec.get("requirements"):
        out("run-local: the job's requirements are not installed here: this Python has them")
    out(f"run-local: {workers} worker{'s' if workers > 1 else ''} of {what}")
    out(f"run-local: ETRAIN_CHECKPOINT_DIR={checkpoint_dir}")
    framework = str(spec.get("framework") or command_env.PYTORCH)
    envs = environments(workers, os.environ, str(checkpoint_dir), free_port("127.0.0.1"), framework)
    processes: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            out(line)

    try:
        for rank, env in enumerate(envs):
            read_fd, write_fd = os.pipe()
            env[command_env.REPORT_FD_ENV] = str(write_fd)
            child_fds = [write_fd]
            if not command:
                reply_read, reply_write = os.pipe()
                env[command_env.REPLY_FD_ENV] = str(reply_read)
                child_fds.append(reply_read)
            process = subprocess.Popen(
                argv,
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=tuple(child_fds),
                start_new_session=True,
            )
            for fd in child_fds:
                os.close(fd)
            processes.append(process)
            assert process.stdout is not None
            shown = say if rank == 0 else lambda _: None
            lines: tuple[Callable[..., None], tuple[Any, ...]] = (
                (_points, (read_fd, shown))
                if command
                else (_loop_lines, (read_fd, os.fdopen(reply_write, "wb"), shown))
            )
            jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
                (_pump, (process.stdout, f"[rank {rank}] ", say)),
                lines,
            ]
            for target, args in jobs:
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                threads.append(thread)
        return _wait(processes, grace)
    finally:
        for process in processes:
            stop_group(process, 0)
        for thread in threads:
            thread.join(timeout=5)


def _wait(processes: list[subprocess.Popen[bytes]], grace_s: float) -> int:
    while True:
        codes = [p.poll() for p in processes]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            for process in processes:
                stop_group(process, grace_s)
            return 128 - failed if failed < 0 else failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)
