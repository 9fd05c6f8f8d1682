"""A command job's process on one worker: started through ``confine.py`` (in a PID
namespace of its own where the worker may make one), its output sent on line by line, its
reports read from a pipe, and stopped: SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from elastic.train import command_env
from elastic.train.metric_points import PointMerger

CONFINE = Path(__file__).with_name("confine.py")
_PR_SET_PDEATHSIG = 1
# The stderr lines a failed command's error quotes.
ERROR_LINES = 5


def _die_with_parent() -> None:
    """In the forked child, before exec: the kernel kills it when the worker's thread that
    started it ends, the worker killed or not."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Running:
    """One worker's command, started."""

    process: subprocess.Popen[bytes]
    stderr_tail: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    # The worker's end of the pipe the child reads answers from (``replies=True``).
    replies: IO[bytes] | None = None

    def exited(self) -> int | None:
        return self.process.poll()

    def stop(self, grace_s: float) -> None:
        stop_group(self.process, grace_s)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=5)
        if self.replies is not None:
            with contextlib.suppress(OSError):
                self.replies.close()


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """End a process started in a session of its own, and its group: SIGTERM, then SIGKILL
    once ``grace_s`` has passed (0: SIGKILL at once)."""

    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)

    if process.poll() is None and grace_s > 0:
        send(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    if process.poll() is None:
        send(signal.SIGKILL)
    process.wait()


def free_port(host: str) -> int:
    """A port free on ``host`` now, for a rendezvous the command makes itself."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pump(stream: IO[bytes], out: Callable[[str], None], tail: list[str] | None) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        out(line)
        if tail is not None:
            tail.append(line)
            del tail[:-ERROR_LINES]
    stream.close()


def _relay_reports(
    read_fd: int, points: PointMerger | None, on_line: Callable[[bytes], None] | None
) -> None:
    with os.fdopen(read_fd, "rb") as pipe:
        for raw in pipe:
            if on_line is not None:
                on_line(raw)
            elif points is not None:
                points.add_line(raw)
    if points is not None:
        points.flush()


def start(
    argv: list[str],
    workdir: Path,
    env: dict[str, str],
    rules: dict[str, Any],
    points: PointMerger | None,
    on_line: Callable[[bytes], None] | None = None,
    replies: bool = False,
) -> Running:
    """Start ``argv`` confined by ``rules``. Each line the child writes to its report pipe
    goes to ``on_line`` when given, else to ``points``; with ``replies``, the child also
    reads a pipe of the worker's (``Running.replies``) whose descriptor is in
    ``ETRAIN_REPLY_FD``."""
    read_fd, write_fd = os.pipe()
    env = {**env, command_env.REPORT_FD_ENV: str(write_fd)}
    child_fds = [write_fd]
    reply_write = -1
    if replies:
        reply_read, reply_write = os.pipe()
        env[command_env.REPLY_FD_ENV] = str(reply_read)
        child_fds.append(reply_read)
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
            pass_fds=tuple(child_fds),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except BaseException:
        if reply_write >= 0:
            os.close(reply_write)
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
    running = Running(process)
    if reply_write >= 0:
        running.replies = os.fdopen(reply_write, "wb")
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
    pumps.append((_relay_reports, (read_fd, points, on_line)))
    for target, args in pumps:
        thread = threading.Thread(target=target, args=args, name="etrain-command-io", daemon=True)
        thread.start()
        running.threads.append(thread)
    return running
