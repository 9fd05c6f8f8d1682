"""What every side of ``bench.recovery`` records per step, and the figures taken from it.

Every side, whatever runs it (Ray Train, torchrun, this service), ends with the same list
of ``StepRecord`` and three times (start, kill, node added back), so every row of the table
is computed by the same code from the same kind of evidence."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

# The sides of bench.recovery in its order, and their column headers; here, away from Ray,
# so the plot of their records (bench/recovery_plot.py) starts without importing it.
SIDES = ["stock", "ray_torchft", "torchrun", "restart", "in_place"]
HEADERS = {
    "stock": "stock Ray Train",
    "ray_torchft": "Ray Train + torchft",
    "torchrun": "torchrun elastic",
    "restart": "ours, restart",
    "in_place": "ours, in_place",
}


@dataclass(frozen=True)
class StepRecord:
    time: float  # wall clock (time.time()) when the worker finished the step
    rank: int  # the worker's rank among the step's participants
    step: int  # the optimizer step the record is for (1-based)
    attempt: str  # one worker group: a restart starts a new attempt, in place never does
    world: int  # participants in the step
    committed: bool  # False: the step was tried and thrown away (a failed all-reduce)
    indices: tuple[int, ...] = ()  # the samples this rank trained on in the step


def lineage(records: list[StepRecord]) -> list[StepRecord]:
    """The records whose steps are in the final model: per step number, the committed
    records of the attempt that committed it last (a restart's redone steps replace the ones
    the lost attempt had run)."""
    first: dict[tuple[int, str], float] = {}
    for r in records:
        key = (r.step, r.attempt)
        first[key] = min(first.get(key, r.time), r.time)
    latest: dict[int, tuple[float, str]] = {}
    for r in records:
        at = first[(r.step, r.attempt)]
        if r.committed and (r.step not in latest or at > latest[r.step][0]):
            latest[r.step] = (at, r.attempt)
    return [r for r in records if r.committed and latest[r.step][1] == r.attempt]


def summarize(
    records: list[StepRecord],
    started: float,
    killed_at: float,
    added_at: float | None,
    steps: int,
    batch: int,
    back_at: float | None = None,
    lost: int = 1,
) -> dict[str, float]:
    """The table's figures for one run; ``lost`` nodes were killed (a moment apart when
    more than one), and "the smaller size" is the world without all of them.

    With ``back_at``, the kill was the job's supervisor's, and ``back_at`` when its successor
    said so (its ``supervisor_recreated`` event). The world does not shrink then: instead of
    ``recovery_s``, ``supervisor_back_s`` is the kill to ``back_at`` and ``resumed_s`` the
    kill to the first committed step after it, which ends the span ``pause_s`` looks at.

    - recovery_s: the kill to the first committed step at a world smaller than the kill's;
    - pause_s: the longest gap between committed steps from the last one before the kill to
      that first one at the smaller size;
    - steps_redone: step numbers tried more than once (a discarded try, or a restart's lost
      attempt) around the kill;
    - samples_lost / samples_doubled: the final model's steps hold ``steps * batch`` samples,
      each once, in an exact run; lost is what smaller batches left out, doubled what went
      in more than once;
    - grow_s / grow_pause_s: the node added back to the first committed step at a bigger
      world, and the longest gap between committed steps in that span (absent when the
      job did not grow before it ended);
    - wall_s: start to the last step;
    - split_brain: replicas that trained the whole job again alone after it had ended;
    - steady_sps: samples/s at the starting world size, over the steps before the kill.
    """
    # A replica that trained the job again alone, after it had ended (split brain), made
    # a second model: counted, and kept out of every other figure.
    alone = {r.attempt for r in records if r.attempt.startswith("split-brain:")}
    records = [r for r in records if r.attempt not in alone]
    done = sorted((r for r in records if r.committed), key=lambda r: r.time)
    before = [r for r in done if r.time <= killed_at]
    world_at_kill = max(r.world for r in before if r.time == before[-1].time)
    out: dict[str, float]
    if back_at is None:
        smaller = next(r for r in done if r.time > killed_at and r.world <= world_at_kill - lost)
        out = {"recovery_s": smaller.time - killed_at}
    else:
        smaller = next(r for r in done if r.time > back_at)
        out = {"supervisor_back_s": back_at - killed_at, "resumed_s": smaller.time - killed_at}
    out |= {
        "pause_s": _longest_gap(done, before[-1].time, smaller.time),
        "wall_s": max(r.time for r in done if r.step == steps) - started,
        "split_brain": len(alone),
    }
    kept = lineage(records)
    kept_set = set(kept)
    out["steps_redone"] = len(
        {r.step for r in records if r not in kept_set and r.time <= smaller.time}
    )
    if any(r.indices for r in kept):
        counts = Counter(i for r in kept for i in r.indices)
        trained = sum(counts.values())
        out["samples_lost"] = max(0, steps * batch - trained)
        out["samples_doubled"] = trained - len(counts)
    if added_at is not None:
        world_after = smaller.world
        bigger = next(
            (r for r in done if r.time > added_at and r.world > world_after),
            None,
        )
        if bigger is not None:
            out["grow_s"] = bigger.time - added_at
            out["grow_pause_s"] = _longest_gap(done, added_at, bigger.time)
    steady = sorted({r.step: r.time for r in before if r.world == world_at_kill}.items())
    if len(steady) > 6:
        # Past the first steps (warm-up), per committed step of the starting world.
        (s0, t0), (s1, t1) = steady[3], steady[-1]
        out["steady_sps"] = (s1 - s0) * batch / (t1 - t0)
    return out


def _longest_gap(done: list[StepRecord], start: float, end: float) -> float:
    """The longest time between one committed step and the next in [start, end]; the span
    starts at ``start`` itself when no step was committed exactly then."""
    times = sorted({start, *(r.time for r in done if start <= r.time <= end)})
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
