"""The job state machine: one table of legal transitions that everything else asks. It sits in
the lowest layer because every layer needs it: the supervisor drives it, the service folds and
checks it, the client and the dashboard show it."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_ENDINGS = {JobState.FAILED, JobState.CANCELLED}

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, *_ENDINGS}),
    # Back to queued when its workers could not be placed (another job took the capacity).
    JobState.STARTING: frozenset(
        {JobState.QUEUED, JobState.RUNNING, JobState.RECOVERING, *_ENDINGS}
    ),
    # A job can finish straight from running; succeeded is reachable only from there. Back to
    # queued when the scheduler preempts it for a job of higher priority.
    JobState.RUNNING: frozenset(
        {JobState.RECOVERING, JobState.SUCCEEDED, JobState.QUEUED, *_ENDINGS}
    ),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.QUEUED, *_ENDINGS}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: JobState, target: JobState) -> None:
        super().__init__(f"a job cannot go from {current.value} to {target.value}")
        self.current = current
        self.target = target


def can_transition(current: JobState, target: JobState) -> bool:
    return target in TRANSITIONS[current]


def check_transition(current: JobState, target: JobState) -> JobState:
    """Return ``target`` when the move is legal, else raise :class:`IllegalTransition`."""
    if not can_transition(current, target):
        raise IllegalTransition(current, target)
    return target
