"""One attempt of a job (one process group of its workers, from start to end) and the recovery
that spans attempts after a failure: plain data, no Ray."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from elastic.cluster.scheduling import Placement
from elastic.events import WorldChange

REPORT_WINDOW = 64


class EndCause(StrEnum):
    """Why an attempt ended, as the restart policy tells them apart."""

    FINISHED = "finished"  # the training loop returned
    PAUSED = "paused"  # stopped at a checkpoint so that the job can grow
    ERROR = "error"  # the training loop raised, on some rank
    CODE_ERROR = "code_error"  # the job's code could not be loaded: no retry can help
    NODE_LOST = "node_lost"  # a node it ran on left the cluster, or a worker process died
    START_TIMEOUT = "start_timeout"  # its workers were not all placed in time
    CANCELLED = "cancelled"


@dataclass
class AttemptOutcome:
    """What the runner reports when an attempt's ``fit()`` returns."""

    error: str | None = None
    dead_ranks: list[int] = field(default_factory=list)
    # The error is the job's code failing to load (elastic.train.entrypoint.EntrypointError).
    code_error: bool = False
    # rank -> node of the dead ranks the runner had placed: one that died before it
    # registered with the supervisor (in its group's join) is known by this only.
    dead_nodes: dict[int, str] = field(default_factory=dict)


@dataclass
class Attempt:
    number: int
    world_size: int
    resume_step: int | None  # the checkpoint it started from
    started_at: float
    worker_nodes: dict[int, str] = field(default_factory=dict)
    reached_step: int = 0  # the highest step any report named
    completed_step: int = 0  # the highest step known to have completed
    checkpoint_step: int | None = None  # the newest checkpoint, saved or restored
    saved_checkpoint: bool = False  # progress: a checkpoint written by this attempt
    running: bool = False  # a first step was reported
    first_signal_at: float | None = None  # the earliest sign of a failure, from anyone
    detected_at: float | None = None  # when the supervisor acted on it
    stop_cause: EndCause | None = None  # set when the supervisor ends the attempt itself
    stop_reason: str | None = None
    grow_to: int | None = None  # a grow is reserved: pause at the next checkpoint
    # The scheduler's order to shrink (or, below min_workers, to give every worker back):
    # pause at the next step, with a checkpoint of it.
    shrink: Placement | None = None
    grow_reason: Placement | None = None  # the scheduler's word for a grow it allowed
    paused_at: int | None = None
    ended: bool = False
    # The steps whose metrics were logged lately. In place, a replica that becomes the
    # quorum's reporter sends the last report again (its reporter may have died with it in
    # flight); it is logged once. Duplicates come within a few steps: a window is enough.
    recent_reports: deque[int] = field(default_factory=lambda: deque(maxlen=REPORT_WINDOW))

    def __post_init__(self) -> None:
        self.reached_step = self.completed_step = self.resume_step or 0
        self.checkpoint_step = self.resume_step

    def saw_step(self, step: int, completed: int | None) -> None:
        self.reached_step = max(self.reached_step, step)
        self.completed_step = max(self.completed_step, step if completed is None else completed)

    def first_report(self, step: int) -> bool:
        """Whether the metrics of ``step`` are new to this attempt (then they are noted)."""
        if step in self.recent_reports:
            return False
        self.recent_reports.append(step)
        return True

    def saw_failure(self, at: float) -> None:
        self.first_signal_at = at if self.first_signal_at is None else min(self.first_signal_at, at)

    @property
    def all_placed(self) -> bool:
        return len(self.worker_nodes) >= self.world_size


@dataclass
class Recovery:
    """From the first failure signal (or a pause to grow) until the first step of the
    attempt that carries on: it spans every attempt that failed on the way."""

    kind: str  # "loss", "failure", "grow", "drain", "shrink" or "preempt"
    from_world: int
    completed_step: int  # the furthest step completed before the failure
    failed_at: float  # the first failure signal, or when the pause began
    detected_at: float
    attempts: int = 1  # attempts that ended on the way
    checkpoint_step: int | None = None  # the one restored, once known
    decision: Placement | None = None  # the scheduler's, when it ordered this resize

    @property
    def steps_redone(self) -> int:
        return max(0, self.completed_step - (self.checkpoint_step or 0))

    def as_event(
        self, kind: type[WorldChange], to_world: int | None, now: float | None, **more: Any
    ) -> WorldChange:
        """The recovery so far as the data of an event of ``kind``; ``more``: the event's
        own fields (the nodes lost, the reason), over the recovery's."""
        fields: dict[str, Any] = {
            "from_world": self.from_world,
            "to_world": to_world,
            "checkpoint_step": self.checkpoint_step,
            "steps_redone": self.steps_redone,
            "detection_seconds": round(max(0.0, self.detected_at - self.failed_at), 3),
            "recovery_seconds": None if now is None else round(now - self.failed_at, 3),
            "attempts": self.attempts,
        }
        return kind(**(fields | more))
