"""A replica dies with its raylet.

When a node's raylet dies (killed, OOM, crashed), Ray's workers on it notice only at their
next check of it, once a second (Ray's ``raylet_death_check_interval_milliseconds``), and
exit then. Meanwhile a replica keeps heartbeating to the lighthouse and sits in the
survivors' collectives, but its node is already lost to Ray: it is replaced, never trusted
again. Every millisecond it lingers is a millisecond the survivors pause.

A Ray worker is a child of its node's raylet: when the raylet dies the worker is re-parented
(to init or a subreaper). A thread polls for that and ends the process at once, as a machine
that lost power would: the kernel closes its sockets, and the survivors' collectives fail
now rather than a second later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

POLL_S = 0.05


def command_line(pid: int) -> bytes:
    """The process's NUL-separated argv; empty when it is gone (or there is no /proc)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()
    return b""


def die_with_parent(parent_name: bytes = b"raylet", poll_s: float = POLL_S) -> bool:
    """Start the watch; False (no watch) when this process's parent is not named
    ``parent_name`` (a local-mode worker, a platform without ``/proc``)."""
    parent = os.getppid()
    executable = command_line(parent).split(b"\0", 1)[0]
    if not executable.endswith(parent_name):
        return False

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-raylet", daemon=True).start()
    return True
