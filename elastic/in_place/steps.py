"""The pure arithmetic of a quorum-aware step: which samples each participant trains on,
how its loss is weighted, and what a change of quorum cost (pause, steps redone).

No torch, no Ray, no torchft: unit-tested in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic.events import EventKind, Joined, Resized, WorkerLost, WorldChange
from elastic.train.sampling import SamplerPosition, share


def step_positions(position: SamplerPosition, dataset_size: int, global_batch: int) -> range:
    """Positions ``[k*B, (k+1)*B)`` of the epoch's permutation that the step at ``position``
    consumes (the epoch's last step may be shorter)."""
    start = position.consumed
    return range(start, min(start + global_batch, dataset_size))


def participant_indices(
    permutation: np.ndarray,
    position: SamplerPosition,
    dataset_size: int,
    global_batch: int,
    participants: int,
    rank: int,
) -> tuple[list[int], int]:
    """(this participant's dataset indices, the step's global batch): the step's positions
    split over the quorum's participants by their rank in it, contiguous and differing by at
    most one sample."""
    positions = step_positions(position, dataset_size, global_batch)
    batch = permutation[positions.start : positions.stop]
    start, end = share(len(batch), participants, rank)
    return [int(i) for i in batch[start:end]], len(batch)


def loss_weight(global_batch: int) -> float:
    """Each participant's per-sample losses are summed and weighted by this: the gradients'
    all-reduce (a sum over the participants) is then the exact mean over the global batch,
    whatever the quorum's size and split."""
    return 1.0 / global_batch


@dataclass
class QuorumChange:
    """What one change of the quorum cost, measured by a replica that went through it."""

    # "worker_lost" when replicas left the quorum (it shrank, or lost ones were replaced in
    # the same change), "drain" when they left a draining node, "joined" when it only grew
    kind: str
    step: int  # the first step committed with the new quorum
    from_world: int
    to_world: int
    steps_redone: int  # 1 when the step in flight was discarded and redone whole, else 0
    pause_seconds: float  # the gap between the last commit before and the first after
    recovery_seconds: float | None  # from the first failure signal to that commit
    left: list[int] = field(default_factory=list)  # the replicas gone, when known
    joined: list[int] = field(default_factory=list)  # the replicas new, when known

    def as_event(self, kind: type[WorldChange]) -> WorldChange:
        """This change as the data of an event of ``kind`` (see WorldChange): its replicas
        are those that joined for a join, or for a resize that only grew; else those lost."""
        joining = kind is Joined or self.kind == "joined"
        return kind(
            from_world=self.from_world,
            to_world=self.to_world,
            steps_redone=self.steps_redone,
            recovery_seconds=None
            if self.recovery_seconds is None
            else round(self.recovery_seconds, 4),
            pause_seconds=round(self.pause_seconds, 4),
            step=self.step,
            in_place=True,
            replicas=tuple(self.joined if joining else self.left),
            reason="drain" if self.kind == "drain" else None,
        )


_KINDS: dict[str, type[WorldChange]] = {"worker_lost": WorkerLost, "joined": Joined}


def quorum_events(change: QuorumChange) -> list[tuple[EventKind, dict[str, Any]]]:
    """The job's events for a change of the quorum, in order: a loss (a drain is no loss, only
    a resize), a join, and a resize when the size changed. A lost replica replaced in the
    same change is a loss and a join at the same size."""
    kinds: list[type[WorldChange]] = []
    first = _KINDS.get(change.kind)  # none for a drain
    if first is not None:
        kinds.append(first)
    if change.kind == EventKind.WORKER_LOST and change.joined:
        kinds.append(Joined)
    if change.from_world != change.to_world:
        kinds.append(Resized)
    return [(kind.KIND, change.as_event(kind).data()) for kind in kinds]


class Timeline:
    """A replica's committed steps and failed tries, as they happen: each commit with a new
    quorum (another size, or other members) yields the :class:`QuorumChange` that led to it."""

    def __init__(self) -> None:
        self.last_commit: float | None = None
        self.world: int | None = None
        self.members: frozenset[int] | None = None  # of the last commit's quorum, when known
        self.first_failure: float | None = None  # since the last commit
        self.failed_tries = 0  # of the step now in flight
        self.longest_pause = 0.0  # between any two commits seen
        self.draining = False  # replicas were told to leave: the next shrink is theirs

    def expect_drain(self) -> None:
        self.draining = True

    def failed(self, now: float) -> None:
        if self.first_failure is None:
            self.first_failure = now
        self.failed_tries += 1

    def committed(
        self, step: int, world: int, now: float, members: frozenset[int] | None = None
    ) -> QuorumChange | None:
        change = None
        gap = None if self.last_commit is None else now - self.last_commit
        if gap is not None:
            self.longest_pause = max(self.longest_pause, gap)
        left: list[int] = []
        joined: list[int] = []
        if members is not None and self.members is not None:
            left, joined = sorted(self.members - members), sorted(members - self.members)
        if self.world is not None and gap is not None and (world != self.world or left or joined):
            lost = world < self.world or bool(left)
            change = QuorumChange(
                kind=("drain" if self.draining else "worker_lost") if lost else "joined",
                step=step,
                from_world=self.world,
                to_world=world,
                steps_redone=1 if self.failed_tries else 0,
                pause_seconds=gap,
                recovery_seconds=None if self.first_failure is None else now - self.first_failure,
                left=left,
                joined=joined,
            )
            if lost:
                self.draining = False
        self.last_commit, self.world, self.members = now, world, members
        self.first_failure, self.failed_tries = None, 0
        return change
