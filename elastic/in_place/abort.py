"""Abort a replica's step in flight when a peer of it is gone.

Gloo cannot abort a collective: ``abort()`` on its process group is a no-op, and a
collective blocked on a peer that stopped without resetting its sockets (a frozen or
cut-off node, a killed node whose process lingers) waits out the collective timeout.
Dropping that process group does not help either: its destructor joins the blocked
Gloo threads, so torchft's reconfigure at the next quorum would wait as long.

So the training thread never blocks on the collective: it waits on the collective's
futures and on an abort request from the supervisor (who hears of the loss from the
lighthouse within its heartbeat timeout). On an abort the step is reported to the
manager as failed (``Manager.report_error``: not committed, redone whole by the next
quorum) and the blocked process group is kept alive by a thread of its own until its
collective ends, so its destructor never runs on the training thread.

torchft's ``ProcessGroupBabyGloo`` can kill a blocked collective, but it spawns a fresh
subprocess (which imports torch, seconds here) at every quorum change: every join and
every loss would cost that.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

# How often the training thread looks at the abort flag while a collective is in flight
# (a collective's completion wakes it at once).
POLL_S = 0.05


class PeerLost(RuntimeError):
    pass


class StepAbort:
    def __init__(self) -> None:
        self._requested = threading.Event()
        self._wake = threading.Event()
        self._quorum_asked = time.monotonic()
        self.aborted_steps = 0

    def new_step(self) -> None:
        """Called before the step's quorum: a request that arrives from here on (during
        the quorum, the compute or the collective) discards this step."""
        self._requested.clear()
        self._quorum_asked = time.monotonic()

    def request(self, dropped_for_s: float) -> bool:
        """From any thread: a replica of the job was dropped by the lighthouse
        ``dropped_for_s`` ago. A step whose quorum was asked for after that has a quorum
        without it and goes on (True: this step is discarded)."""
        if self._quorum_asked > time.monotonic() - dropped_for_s:
            return False
        self._requested.set()
        self._wake.set()
        return True

    def wait_all(self, works: list[Any], manager: Any) -> bool:
        """Wait for the step's collectives: True when they completed (an error in them is
        reported to the manager, as ``Work.wait`` does), False when the step was aborted."""
        # torchft's _ManagedWork chains its error-reporting callbacks only on wait(); the
        # c10d work under it is what can be waited on without blocking. A _DummyWork (the
        # manager already errored this step) has none and completes at once.
        futures = [w._work.get_future() for w in works if hasattr(w, "_work")]
        for f in futures:
            f.add_done_callback(lambda _: self._wake.set())
        while True:
            self._wake.clear()
            if all(f.done() for f in futures):
                break
            if self._requested.is_set():
                self._abandon(futures, manager)
                return False
            self._wake.wait(POLL_S)
        for w in works:
            w.wait()  # returns at once; reports a failed collective to the manager
        return True

    def _abandon(self, futures: list[Any], manager: Any) -> None:
        self.aborted_steps += 1
        manager.report_error(PeerLost("a replica of this step's quorum was lost"))
        # torchft's ProcessGroupGloo wraps the c10d process group as ``_pg``.
        pg = getattr(manager._pg, "_pg", None)
        threading.Thread(target=_bury, args=(pg, futures), daemon=True).start()


def _bury(pg: Any, futures: list[Any]) -> None:
    for f in futures:
        with contextlib.suppress(Exception):
            f.wait()  # ends at the collective timeout, or when the peer's sockets reset
    del pg  # the last reference, dropped here and not on the training thread
