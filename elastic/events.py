"""A job's event log as its supervisor keeps it: typed kinds, numbered in order, held until
the reader (the service) acknowledges that it has stored them.

The store is the archive; this log is only the buffer in front of it, so it has a bound.
At the bound, high-volume kinds (log lines, metrics) are counted instead of kept, and one
``events_dropped`` event says how many of each were lost once the reader catches up. The
kinds that tell the job's story (state changes, attempts, losses, checkpoints) are always
kept: there are few of them per attempt, so they cannot grow without bound on their own.
Sequence numbers stay contiguous, as the store requires.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar


class EventKind(StrEnum):
    STATE = "state"
    ATTEMPT_STARTED = "attempt_started"
    METRICS = "metrics"
    LOG = "log"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_REMOVED = "checkpoint_removed"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    WORKER_LOST = "worker_lost"
    RESTORED = "restored"
    RESIZED = "resized"
    JOINED = "joined"  # in place: a replica joined the quorum, healed from a peer
    WAITING = "waiting"  # the job cannot start or grow yet, and why
    # The cluster's scheduler resized the job (shrunk for a job of higher priority, grew into
    # idle capacity, preempted it): what the supervisor was told, and why.
    SCHEDULED = "scheduled"
    SUPERVISOR_RECREATED = "supervisor_recreated"
    EVENTS_DROPPED = "events_dropped"
    # Sent by a worker whose collective failed, before it raises; the supervisor folds it
    # into the recovery's timing and does not log it on its own.
    FAILURE_SIGNAL = "failure_signal"


# In a metrics report's data: the report says only that an attempt's commands run (a command
# job's first sign of running), and holds no metrics to keep.
COMMANDS_STARTED = "commands_started"


@dataclass(frozen=True)
class WorldChange:
    """The data of an event that changes a job's world: a worker lost, a replica joined, a
    resize, a checkpoint restored. Both modes produce the same fields; what a mode cannot
    know is None (or empty), so a reader never asks which mode wrote it."""

    KIND: ClassVar[EventKind]

    from_world: int
    to_world: int | None = None  # None: not known yet (the next attempt's size decides)
    steps_redone: int | None = None
    # From the first failure signal (or the pause) to the first step at the new size.
    recovery_seconds: float | None = None
    # Restart mode: from the first failure signal to the supervisor's knowing of it.
    detection_seconds: float | None = None
    # In place: the gap between the last commit before the change and the first after it.
    pause_seconds: float | None = None
    checkpoint_step: int | None = None  # the checkpoint a restart resumed from
    step: int | None = None  # in place: the first step committed at the new size
    attempts: int = 1  # attempts that ended on the way
    in_place: bool = False  # the survivors trained on in the same attempt
    nodes: tuple[str, ...] = ()  # the nodes lost, when known
    ranks: tuple[int, ...] = ()  # restart mode: the ranks lost
    replicas: tuple[int, ...] = ()  # in place: the replicas lost, or joined
    reason: str | None = None  # why: the failure, "drain", or the scheduler's word
    for_job: str | None = None  # the job the scheduler made room for

    def data(self) -> dict[str, Any]:
        """As the event log carries it (lists, not tuples: the same after a JSON trip)."""
        fields = {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
        }
        return {"kind": self.KIND, **fields}


class WorkerLost(WorldChange):
    KIND = EventKind.WORKER_LOST


class Joined(WorldChange):
    KIND = EventKind.JOINED


class Resized(WorldChange):
    KIND = EventKind.RESIZED


class Restored(WorldChange):
    KIND = EventKind.RESTORED


DROPPABLE = frozenset({EventKind.LOG, EventKind.METRICS})
# About 10 minutes of a chatty job's log lines at the service's default poll interval.
DEFAULT_MAX_PENDING = 5000

Event = dict[str, Any]


class EventLog:
    def __init__(
        self,
        first_seq: int,
        max_pending: int = DEFAULT_MAX_PENDING,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.next_seq = first_seq
        self.max_pending = max_pending
        self.clock = clock
        self.pending: list[Event] = []
        self.dropped: Counter[str] = Counter()

    def append(
        self,
        kind: EventKind,
        data: dict[str, Any],
        origin: tuple[str, int] | None = None,
        at: float | None = None,
    ) -> Event | None:
        """The event as logged, or None when it was counted as dropped. ``origin``: the
        worker's numbered news it records (sender, number), which the reader keeps track of
        (see elastic/in_place/supervisor_link.py); ``at``: when it happened, if not now."""
        if kind in DROPPABLE and len(self.pending) >= self.max_pending:
            self.dropped[kind.value] += 1
            return None
        if self.dropped and len(self.pending) < self.max_pending:
            self._add(EventKind.EVENTS_DROPPED, dict(self.dropped))
            self.dropped.clear()
        return self._add(kind, data, origin, at)

    def _add(
        self,
        kind: EventKind,
        data: dict[str, Any],
        origin: tuple[str, int] | None = None,
        at: float | None = None,
    ) -> Event:
        event: Event = {
            "seq": self.next_seq,
            "kind": kind.value,
            "time": self.clock() if at is None else at,
            "data": data,
        }
        if origin is not None:
            event["origin"] = list(origin)
        self.pending.append(event)
        self.next_seq += 1
        return event

    def after(self, seq: int) -> list[Event]:
        return [e for e in self.pending if e["seq"] > seq]

    def ack(self, seq: int) -> None:
        self.pending = [e for e in self.pending if e["seq"] > seq]
        if self.dropped and len(self.pending) < self.max_pending:
            self._add(EventKind.EVENTS_DROPPED, dict(self.dropped))
            self.dropped.clear()

    def __len__(self) -> int:
        return len(self.pending)
