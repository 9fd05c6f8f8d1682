"""The supervisor's policies, pure functions of the facts: how many workers a job gets
(sizing), when it is worth growing, what an attempt's end means, and whether to restart
after it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from elastic.supervisor.attempt import EndCause


def choose_world_size(min_workers: int, max_workers: int, fitting: int) -> int | None:
    """The largest size in [min, max] that fits, or None when even min does not."""
    if fitting < min_workers:
        return None
    return min(max_workers, fitting)


def grow_target(world_size: int, max_workers: int, free_fit: int) -> int | None:
    """The size worth a checkpoint-and-restart to grow to, or None. ``free_fit`` counts
    workers that fit in what is free beside the job's own."""
    target = min(max_workers, world_size + free_fit)
    return target if target > world_size else None


def below_min_for_too_long(waited_s: float, grace_s: float) -> bool:
    return waited_s > grace_s


# -- what an attempt's end means -----------------------------------------------------------


@dataclass(frozen=True)
class EndDecision:
    """Why an attempt ended, which of its nodes are gone, and the step it paused at (the
    next attempt resumes from that step's checkpoint)."""

    cause: EndCause
    lost: frozenset[str] = frozenset()
    paused_at: int | None = None
    # Its workers paused to leave drained nodes, and their group failed only as those nodes
    # went (Ray ends a drained node once it is idle): a pause, not a loss.
    left_drained: bool = False


def decide_end(
    stopped_as: EndCause | None,
    error: str | None,
    paused_at: int | None,
    checkpoint_step: int | None,
    shrinking: bool,
    lost: Collection[str],
    drained: Collection[str],
    code_error: bool = False,
) -> EndDecision:
    """``stopped_as``: why the supervisor stopped the attempt, if it did; ``error``: what
    its workers reported, if anything failed; ``shrinking``: the scheduler shrank it (in
    place, its replicas leave at a step with a checkpoint of it); ``lost``: its nodes found
    gone; ``drained``: its nodes a drain notice was for."""
    if shrinking and error is None and paused_at is None and stopped_as is None:
        paused_at = checkpoint_step or 0  # in place, preempted: every replica left at a step
    if stopped_as is not None:
        gone = frozenset(lost) if stopped_as == EndCause.NODE_LOST else frozenset()
        return EndDecision(stopped_as, gone, paused_at)
    if error is None:
        cause = EndCause.PAUSED if paused_at is not None else EndCause.FINISHED
        return EndDecision(cause, frozenset(), paused_at)
    if lost and paused_at is not None and set(lost) <= set(drained):
        return EndDecision(EndCause.PAUSED, frozenset(), paused_at, left_drained=True)
    if lost:
        return EndDecision(EndCause.NODE_LOST, frozenset(lost), paused_at)
    return EndDecision(
        EndCause.CODE_ERROR if code_error else EndCause.ERROR, frozenset(), paused_at
    )


# -- restart or give up ------------------------------------------------------------------

# Ray Train 2.60 leaves these unbounded (-1), so a worker group that can never start retries
# forever. Here every kind of failure has a limit; progress (a checkpoint saved) resets all.
NODE_LOSS_LIMIT = 10  # consecutive node losses without progress (Ray: max_preemption_failures)
# Worker groups in a row that could not be placed (Ray: controller_failure_limit).
START_FAILURE_LIMIT = 3


@dataclass(frozen=True)
class RestartDecision:
    retry: bool
    reason: str  # why it gives up; empty when it retries


class RestartPolicy:
    """Counts failed attempts since the job last made progress, by cause. A job error counts
    against the user's ``max_restarts``; a node loss is the cluster's doing and has its own,
    larger budget, so a long job on churning nodes survives any number of losses as long as
    it checkpoints in between."""

    def __init__(
        self,
        max_restarts: int,
        node_loss_limit: int = NODE_LOSS_LIMIT,
        start_failure_limit: int = START_FAILURE_LIMIT,
    ) -> None:
        self.limits = {
            EndCause.ERROR: max_restarts,
            EndCause.NODE_LOST: node_loss_limit,
            EndCause.START_TIMEOUT: start_failure_limit,
        }
        self.counts: Counter[EndCause] = Counter()

    def decide(self, cause: EndCause, progressed: bool) -> RestartDecision:
        """``progressed``: the attempt that ended saved a checkpoint, so it does not count,
        and the failures before it are forgiven."""
        if cause == EndCause.CODE_ERROR:
            return RestartDecision(False, "its code cannot be loaded: not retried")
        if progressed:
            self.counts.clear()
        if progressed or cause not in self.limits:
            return RestartDecision(True, "")
        done, limit = self.counts[cause], self.limits[cause]
        if done >= limit:
            plural = "" if done == 1 else "s"
            what = {
                EndCause.ERROR: f"gave up after {done} restart{plural}; max_restarts is {limit}",
                EndCause.NODE_LOST: f"gave up after {done} node loss{'' if done == 1 else 'es'} "
                f"in a row without a checkpoint; the limit is {limit}",
                EndCause.START_TIMEOUT: f"gave up after {done} worker group{plural} in a row "
                f"could not start; the limit is {limit}",
            }[cause]
            return RestartDecision(False, what)
        self.counts[cause] += 1
        return RestartDecision(True, "")

    @property
    def restarts(self) -> int:
        return sum(self.counts.values())
