"""The line between an in-place ``Replica`` actor and the confined child that runs its
job's package loop (elastic/in_place/replica_child.py): restart mode's JSON lines
(elastic/train/loop_link.py: events, a code error) and what in place adds.

Up, from the child:

- ``{"call": name}``: a call of the supervisor the in-place context makes, by name from
  :data:`CALLS` only; the actor fills in its arguments (its attempt and replica index), so
  the child's owner code can make it call nothing else and say nothing false in it;
- ``{"outcome": text}``: how the loop ended, one of :data:`OUTCOMES`;
- ``{"aborted": bool, "id": n}``: the answer to abort request ``n``.

Down, from the actor: ``{"abort": dropped_for_s, "id": n}`` (a peer was dropped by the
lighthouse: discard the step in flight), ``{"leave": save}`` (the node is draining),
``{"expect_drain": true}`` and ``{"ping": true}`` every :data:`PING_S`. The child handles
them on the thread that reads its pipe, not in the loop: an abort must reach a loop blocked
in an all-reduce.

The pings keep a hung actor from hiding behind its child. The child heartbeats to the
lighthouse itself, so an actor that is frozen (stopped, or stuck holding its GIL) would stay
in every quorum while it relays nothing, and its child would soon block on a full pipe with
its peers waiting on it. A child that hears nothing from its actor for
:data:`PARENT_SILENT_S` exits instead: its heartbeats stop, the lighthouse drops the
replica, and the supervisor fences it as it fences any silent replica.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import struct
import sys
import termios
import threading
import time
from typing import IO, Any

from elastic.train.loop_link import ChildRelay, ParentLink, PipedWorker

log = logging.getLogger(__name__)

# The supervisor's methods a replica's child may have its actor call.
CALLS = frozenset({"replica_trained"})
OUTCOMES = frozenset({"finished", "finished as a replica", "left"})
# The exit status of a child whose actor went silent.
PARENT_SILENT_EXIT = 4
# How long the actor's ``abort_step`` waits for its child's answer. The answer takes
# milliseconds (two pipe writes and a flag); a child that cannot answer sooner is dying or
# frozen, and then its step holds no peer anyway.
ABORT_ANSWER_S = 1.0
# The actor's pings to its child, and how long the child goes without a word from its actor
# before it takes the actor for hung. Ten pings' worth: a busy node delays a ping by far
# less; a hung actor costs its peers this long plus the lighthouse's heartbeat timeout.
PING_S = 0.2
PARENT_SILENT_S = 2.0


class ReplicaRelay(ChildRelay):
    """The actor's end: restart mode's relay, with the calls, the outcome and the control
    messages of a replica. ``supervisor`` is the actor's link to its supervisor."""

    def __init__(self, worker: Any, supervisor: Any, attempt: int, replica: int) -> None:
        super().__init__(worker, None)  # ``elastic_train.report`` points: none in place
        self.supervisor = supervisor
        self.attempt = attempt
        self.replica = replica
        self.outcome: str | None = None
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, list[bool]]] = {}
        self._waiting_lock = threading.Lock()

    def attach(self, replies: IO[bytes]) -> None:
        super().attach(replies)
        threading.Thread(target=self._ping, name="etrain-child-ping", daemon=True).start()

    def _ping(self) -> None:
        while self.outcome is None and self._answer({"ping": True}):
            time.sleep(PING_S)

    def line(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if isinstance(message, dict):
            if "call" in message:
                self._call(message["call"])
                return
            if "outcome" in message:
                outcome = message["outcome"]
                if isinstance(outcome, str) and outcome in OUTCOMES:
                    self.outcome = outcome
                else:
                    log.warning("an outcome from the loop's process is dropped: %r", outcome)
                return
            if "aborted" in message:
                self._answered(message.get("id"), bool(message["aborted"]))
                return
        super().line(raw)

    def _call(self, name: Any) -> None:
        if name not in CALLS:
            log.warning("a call from the loop's process is refused: %r", str(name)[:40])
            return
        if name == "replica_trained":
            self.supervisor.replica_trained.remote(self.attempt, self.replica)

    def _answered(self, key: Any, aborted: bool) -> None:
        with self._waiting_lock:
            waiting = self._waiting.get(key) if isinstance(key, int) else None
        if waiting is not None:
            waiting[1].append(aborted)
            waiting[0].set()

    def abort_step(self, dropped_for_s: float) -> bool:
        """Forwarded to the child; its answer (False when it has none in time)."""
        if not self._attached.is_set():  # no child yet: no step in flight
            return False
        key = next(self._ids)
        done, answer = threading.Event(), list[bool]()
        with self._waiting_lock:
            self._waiting[key] = (done, answer)
        try:
            self._answer({"abort": float(dropped_for_s), "id": key})
            done.wait(ABORT_ANSWER_S)
        finally:
            with self._waiting_lock:
                self._waiting.pop(key, None)
        return bool(answer and answer[0])

    def leave(self, save: bool) -> None:
        self._answer({"leave": bool(save)})

    def expect_drain(self) -> None:
        self._answer({"expect_drain": True})


class ReplicaControl:
    """The child's end of the control messages, for its :class:`InPlaceContext` once there
    is one; what comes before is kept for it."""

    def __init__(self) -> None:
        self.link: ParentLink | None = None
        self.ctx: Any = None
        self._lock = threading.Lock()
        self._leave: bool | None = None
        self._expect_drain = False
        self.heard = time.monotonic()  # the latest word from the actor

    def watch_parent(self, reply_fd: int, silent_s: float = PARENT_SILENT_S) -> None:
        """Exits the process once the actor has said nothing for ``silent_s``."""
        threading.Thread(
            target=self._watch, args=(reply_fd, silent_s), name="etrain-watch-actor", daemon=True
        ).start()

    def _watch(self, reply_fd: int, silent_s: float) -> None:
        tick = time.monotonic()
        while True:
            time.sleep(PING_S)
            now = time.monotonic()
            if now - tick > silent_s / 2 or _unread(reply_fd):
                # This process was starved itself (its own sleep overran), or the actor's
                # words wait in the pipe for the reading thread: the actor is not silent.
                self.heard = max(self.heard, now)
            tick = now
            if now - self.heard > silent_s:
                sys.stderr.write(
                    f"[elastic-train] this replica's actor has said nothing for {silent_s:.0f} "
                    "s (hung or stopped): its loop stops, so its peers go on without it\n"
                )
                sys.stderr.flush()
                os._exit(PARENT_SILENT_EXIT)

    def attach(self, ctx: Any) -> None:
        with self._lock:
            self.ctx = ctx
            if self._expect_drain:
                ctx.timeline.expect_drain()
            if self._leave is not None:
                ctx.save_on_leave = self._leave
                ctx.leaving.set()

    def handle(self, message: dict[str, Any]) -> None:
        self.heard = time.monotonic()
        if message.get("ping"):
            return
        if "abort" in message:
            ctx = self.ctx
            aborted = ctx is not None and bool(ctx.abort.request(float(message["abort"])))
            if self.link is not None:
                self.link.send({"aborted": aborted, "id": message.get("id")})
            return
        with self._lock:
            if "leave" in message:
                self._leave = bool(message["leave"])
                if self.ctx is not None:
                    self.ctx.save_on_leave = self._leave
                    self.ctx.leaving.set()
            elif message.get("expect_drain"):
                self._expect_drain = True
                if self.ctx is not None:
                    self.ctx.timeline.expect_drain()


def _unread(fd: int) -> bool:
    """Whether bytes wait in the pipe ``fd``."""
    try:
        waiting = fcntl.ioctl(fd, termios.FIONREAD, struct.pack("i", 0))
    except OSError:
        return False
    return bool(struct.unpack("i", waiting)[0])


class ReplicaChildWorker(PipedWorker):
    """A replica's worker context in its child: events go up the pipe, and into the
    TensorBoard files the child writes while it is its quorum's rank 0."""

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        super().emit(kind, data)
        if self.tensorboard is not None:
            self.tensorboard.record(kind, data)
