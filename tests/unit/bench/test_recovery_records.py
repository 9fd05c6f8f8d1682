"""The recovery bench's one summary, on hand-made step records: every side's figures come
from it, so its arithmetic is checked here, in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.recovery_records import StepRecord, lineage, summarize

BATCH = 6


def steps(
    attempt: str, first: int, last: int, world: int, t0: float, dt: float = 1.0
) -> list[StepRecord]:
    """One record per rank per step, each rank with its contiguous share of positions
    [k*B, (k+1)*B) (a resize-invariant sampler: the same samples at any world size)."""
    out = []
    for n, step in enumerate(range(first, last + 1)):
        share = BATCH // world
        for rank in range(world):
            start = (step - 1) * BATCH + rank * share
            out.append(
                StepRecord(
                    t0 + n * dt,
                    rank,
                    step,
                    attempt,
                    world,
                    True,
                    tuple(range(start, start + share)),
                )
            )
    return out


def test_a_restart_redoes_the_steps_since_its_checkpoint_and_counts_no_sample_twice() -> None:
    # Steps 1-12 at 3 workers (t=0..11), a kill at t=11.5, a restart from the checkpoint at
    # step 10 that trains steps 11-20 at 2 workers from t=20.
    records = steps("a", 1, 12, 3, 0.0) + steps("b", 11, 20, 2, 20.0)
    figures = summarize(records, 0.0, 11.5, None, 20, BATCH)
    assert figures["recovery_s"] == pytest.approx(8.5)
    assert figures["pause_s"] == pytest.approx(9.0)  # step 12 at t=11 to step 11 at t=20
    assert figures["steps_redone"] == 2  # 11 and 12, replaced by attempt b's
    assert figures["samples_lost"] == 0
    assert figures["samples_doubled"] == 0
    assert figures["split_brain"] == 0
    assert figures["wall_s"] == pytest.approx(29.0)
    # Steps 4..12 at 3 workers: 8 steps of 6 samples in 8 s.
    assert figures["steady_sps"] == pytest.approx(6.0)
    assert "grow_s" not in figures


def test_a_stock_restart_that_replays_its_epoch_counts_the_replayed_samples_twice() -> None:
    # The restart resumes at step 11 but its loader starts the epoch again (positions of
    # steps 1-10): 60 samples go into the model twice, and the last 60 never.
    replay = [
        StepRecord(r.time, r.rank, r.step + 10, "b", r.world, True, r.indices)
        for r in steps("b", 1, 10, 2, 20.0)
    ]
    figures = summarize(steps("a", 1, 12, 3, 0.0) + replay, 0.0, 11.5, None, 20, BATCH)
    assert figures["samples_doubled"] == 60
    assert figures["samples_lost"] == 0  # as many samples as an exact run, just not the same


def test_in_place_a_discarded_step_is_one_step_redone_and_a_join_is_measured() -> None:
    # Steps 1-12 at 3 (t=0..11), kill at 11.5, step 13 tried and thrown away at t=11.6,
    # redone at 2 from t=12.2; a node back at t=20 joins at step 22 (t=21.2).
    records = steps("x", 1, 12, 3, 0.0)
    records.append(StepRecord(11.6, 0, 13, "x", 3, False, ()))
    records += steps("x", 13, 21, 2, 12.2)
    records += steps("x", 22, 30, 3, 21.2)
    figures = summarize(records, 0.0, 11.5, 20.0, 30, BATCH)
    assert figures["recovery_s"] == pytest.approx(0.7)
    assert figures["pause_s"] == pytest.approx(1.2)
    assert figures["steps_redone"] == 1
    assert figures["samples_lost"] == figures["samples_doubled"] == 0
    assert figures["grow_s"] == pytest.approx(1.2)
    assert figures["grow_pause_s"] == pytest.approx(1.0)  # the steps go on while it joins


def test_a_supervisor_lost_in_place_pauses_nothing_and_in_restart_mode_redoes_steps() -> None:
    # The supervisor is killed at t=11.5 and its successor speaks at t=14.2. In place the
    # replicas train on (a step a second); in restart mode a new group starts from the
    # checkpoint at step 10 at t=16.
    in_place = steps("x", 1, 20, 3, 0.0)
    figures = summarize(in_place, 0.0, 11.5, None, 20, BATCH, back_at=14.2)
    assert figures["supervisor_back_s"] == pytest.approx(2.7)
    assert figures["resumed_s"] == pytest.approx(3.5)  # step 16 at t=15
    assert figures["pause_s"] == pytest.approx(1.0)
    assert figures["steps_redone"] == 0 and "recovery_s" not in figures
    restart = steps("a", 1, 12, 3, 0.0) + steps("b", 11, 20, 3, 16.0)
    figures = summarize(restart, 0.0, 11.5, None, 20, BATCH, back_at=14.2)
    assert figures["resumed_s"] == pytest.approx(4.5)
    assert figures["pause_s"] == pytest.approx(5.0)  # step 12 at t=11 to step 11 at t=16
    assert figures["steps_redone"] == 2
    assert figures["samples_lost"] == figures["samples_doubled"] == 0


def test_two_nodes_lost_a_moment_apart_count_until_the_world_without_both() -> None:
    # Steps 1-12 at 3 (t=0..11), kills at 11.5 and 11.8; one step at 2 at t=12.0 (the
    # second loss not noticed yet), a 1.5 s wait for the dead member, then steps at 1.
    records = steps("x", 1, 12, 3, 0.0) + steps("x", 13, 13, 2, 12.0)
    records += steps("x", 14, 20, 1, 13.5)
    figures = summarize(records, 0.0, 11.5, None, 20, BATCH, lost=2)
    assert figures["recovery_s"] == pytest.approx(2.0)
    assert figures["pause_s"] == pytest.approx(1.5)
    assert figures["samples_lost"] == figures["samples_doubled"] == 0


def test_a_smaller_quorum_with_a_fixed_batch_per_replica_loses_samples() -> None:
    # torchft's way: 2 samples per replica, so 4 per step at 2 replicas, not 6.
    records = steps("t", 1, 12, 3, 0.0)
    for n, step in enumerate(range(13, 21)):
        for rank in range(2):
            start = (step - 1) * BATCH + rank * 2
            records.append(StepRecord(12.0 + n, rank, step, "t", 2, True, (start, start + 1)))
    figures = summarize(records, 0.0, 11.5, None, 20, BATCH)
    assert figures["samples_lost"] == 8 * 2
    assert figures["samples_doubled"] == 0


def test_a_replica_that_retrains_the_job_alone_is_set_apart() -> None:
    records = steps("t", 1, 12, 3, 0.0) + steps("t", 13, 20, 2, 12.0)
    alone = [
        StepRecord(r.time, 0, r.step, "split-brain:9", 1, True, r.indices[:2])
        for r in steps("s", 1, 20, 3, 30.0)
        if r.rank == 0
    ]
    figures = summarize(records + alone, 0.0, 11.5, None, 20, BATCH)
    assert figures["split_brain"] == 1
    assert figures["wall_s"] == pytest.approx(19.0)  # the job's end, not the lone replica's
    assert figures["samples_lost"] == figures["samples_doubled"] == 0


def test_lineage_keeps_the_attempt_that_committed_a_step_last() -> None:
    records = steps("a", 1, 3, 2, 0.0) + steps("b", 2, 3, 1, 10.0)
    kept = lineage(records)
    assert sorted((r.step, r.attempt, r.rank) for r in kept) == [
        (1, "a", 0),
        (1, "a", 1),
        (2, "b", 0),
        (3, "b", 0),
    ]


def test_restart_steps_whose_reports_died_with_the_supervisor_come_from_the_audit(
    tmp_path: Path,
) -> None:
    """Restart mode, 2 ranks: attempt 1 reported steps 1-2 and trained 3 and 4, whose reports
    died with its supervisor; attempt 2 restored the checkpoint of step 3 and redid 4. Step
    3 is in the final model (from the audit, each rank's share), step 4 once (attempt 2's)."""
    from bench.recovery_hosts import with_unreported_steps

    def samples(step: int) -> list[int]:
        return list(range((step - 1) * BATCH, step * BATCH))

    audit = tmp_path / "samples"
    audit.mkdir()
    for attempt, trained in (("1", [1, 2, 3, 4]), ("2", [4, 5])):
        for rank in (0, 1):
            lines = [
                json.dumps({"a": int(attempt), "s": s, "i": samples(s)[rank * 3 : rank * 3 + 3]})
                for s in trained
            ]
            (audit / f"attempt-{attempt}-rank-{rank}.jsonl").write_text("\n".join(lines))
    reported = [
        StepRecord(1.0, 0, 1, "1", 2, True, tuple(samples(1))),
        StepRecord(2.0, 0, 2, "1", 2, True, tuple(samples(2))),
        StepRecord(10.0, 0, 4, "2", 2, True, tuple(samples(4))),
        StepRecord(11.0, 0, 5, "2", 2, True, tuple(samples(5))),
    ]
    records = with_unreported_steps(reported, tmp_path)
    added = [r for r in records if r not in reported]
    assert [(r.attempt, r.step, r.time, sorted(r.indices)) for r in added] == [
        ("1", 3, 2.0, samples(3)),
        ("1", 4, 2.0, samples(4)),
    ]
    figures = summarize(records, 0.0, 2.5, None, 5, BATCH, back_at=3.0)
    assert (figures["samples_lost"], figures["samples_doubled"]) == (0, 0)
