"""A Ray head's GCS with its state in Redis (GCS fault tolerance, as KubeRay's
gcsFaultToleranceOptions sets it up), killed and started again by the tests of head loss.

The development and CI machines run a Redis on 127.0.0.1:6379; where none answers, those
tests skip, saying so. Each head keeps its state under a Redis namespace of its own, which
:func:`forget` deletes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import wait_for

REDIS = ("127.0.0.1", 6379)
NO_REDIS = (
    "GCS fault tolerance needs a Redis on 127.0.0.1:6379 (the development and CI machines "
    "run one); none answers here"
)


def redis(*args: str) -> bytes:
    """One command's raw reply (RESP) from the Redis at REDIS."""
    request = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection(REDIS, timeout=2) as conn:
        conn.sendall(request.encode())
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def redis_answers() -> bool:
    try:
        return redis("PING") == b"+PONG\r\n"
    except OSError:
        return False


def fault_tolerant_env(namespace: str) -> dict[str, str]:
    """What a head's environment adds to keep its GCS's state in Redis under ``namespace``."""
    return {
        "RAY_REDIS_ADDRESS": f"{REDIS[0]}:{REDIS[1]}",
        "RAY_external_storage_namespace": namespace,
    }


def forget(namespace: str) -> None:
    """Delete a head's state from Redis."""
    from ray._private.gcs_utils import cleanup_redis_storage

    cleanup_redis_storage(REDIS[0], REDIS[1], "", False, namespace)
    assert redis("KEYS", f"*{namespace}*") == b"*0\r\n"


def in_sessions(sessions: Iterable[int]) -> list[int]:
    """The processes of these sessions (a `ray start` without --block leaves its head's
    processes in the session it was started in)."""
    wanted, found = set(sessions), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) in wanted:
                    found.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return found


def end_sessions(sessions: Iterable[int]) -> None:
    """Every process of these sessions ends: SIGTERM, then SIGKILL a second later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in in_sessions(sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(1)


def program_in(sessions: Iterable[int], name: str) -> int | None:
    """The pid of the process of ``sessions`` whose program is ``name`` (gcs_server,
    raylet), or None."""
    for pid in in_sessions(sessions):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if argv0.endswith(b"/" + name.encode()) and not zombie(pid):
            return pid
    return None


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass(frozen=True)
class GcsCommand:
    """How a GCS process was started: program and arguments, environment, directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    @classmethod
    def of(cls, pid: int) -> GcsCommand:
        proc = Path(f"/proc/{pid}")
        return cls(
            [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]],
            dict(
                item.decode().split("=", 1)
                for item in (proc / "environ").read_bytes().split(b"\0")
                if b"=" in item
            ),
            os.readlink(proc / "cwd"),
        )

    def start(self, sessions: list[int], within: Sequence[str] = ()) -> int:
        """Start it again, under the command prefix ``within``; its session joins
        ``sessions``. Returns its pid."""
        again = subprocess.Popen(
            [*within, *self.argv],
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        sessions.append(again.pid)
        return again.pid


def kill_gcs(sessions: list[int], within: Sequence[str] = ()) -> Callable[[], int]:
    """SIGKILL the GCS of the head whose processes are in ``sessions``; returns what starts
    it again as it was started (:class:`GcsCommand`, under the command prefix ``within``)
    and gives the new pid."""
    pid = program_in(sessions, "gcs_server")
    assert pid is not None, "the head has no gcs_server process"
    command = GcsCommand.of(pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or zombie(pid), 30, what="the GCS to die")
    return lambda: command.start(sessions, within)
