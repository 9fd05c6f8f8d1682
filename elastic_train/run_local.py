"""``etrain run-local job.yaml --code DIR --workers N``: a command job on this machine, with
no service and no Ray, as the cluster runs it: N processes of the command, each with the
environment torchrun gives a worker and the job's ``ETRAIN_CHECKPOINT_DIR``; rank 0's
``elastic_train.report`` points are printed. A quick test before submitting.

Like torchrun, the first process to fail ends the others (SIGTERM, then SIGKILL after the
spec's ``stop_grace_s``); its status is the run's."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
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


class RunLocalError(ValueError):
    """A job that run-local cannot run; the message says why."""


def environments(
    workers: int, base: Mapping[str, str], checkpoint_dir: str, port: int
) -> list[dict[str, str]]:
    """Each local worker's environment: ``base`` with torchrun's variables for one node."""
    places = command_env.places(["local"] * workers)
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
            command_env.CHECKPOINT_DIR_ENV: checkpoint_dir,
        }
        for rank in range(workers)
    ]


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


def run_local(
    spec: Mapping[str, Any],
    code_dir: str | os.PathLike[str],
    workers: int,
    out: Callable[[str], None] = print,
) -> int:
    """Run the command job ``spec`` from ``code_dir`` with ``workers`` processes; returns
    the first failed process's status, or 0."""
    command: Sequence[str] | None = spec.get("command")
    if not command:
        raise RunLocalError(
            "run-local runs command jobs (command: [...]); a workload runs on the service"
        )
    if workers < 1:
        raise RunLocalError(f"--workers must be at least 1, not {workers}")
    grace = float(spec.get("stop_grace_s", 30.0))
    root = Path(code_dir).resolve()
    checkpoint_dir = root / LOCAL_DIR / str(spec.get("name") or "job")
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    argv = command_env.resolve_argv(list(command))
    out(f"run-local: {workers} worker{'s' if workers > 1 else ''} of {shlex.join(argv)}")
    out(f"run-local: ETRAIN_CHECKPOINT_DIR={checkpoint_dir}")
    envs = environments(workers, os.environ, str(checkpoint_dir), free_port("127.0.0.1"))
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
            process = subprocess.Popen(
                argv,
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
            os.close(write_fd)
            processes.append(process)
            assert process.stdout is not None
            jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
                (_pump, (process.stdout, f"[rank {rank}] ", say)),
                (_points, (read_fd, say if rank == 0 else lambda _: None)),
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
