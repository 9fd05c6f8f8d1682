import pytest

from elastic.supervisor.policy import below_min_for_too_long, grow_target
from elastic.train.context import (
    LoopSettings,
    micro_batch_plan,
    micro_batches,
    passes_per_step,
    total_steps,
)
from elastic.train.lr_schedule import lr_factor


def test_warmup_then_cosine_to_zero() -> None:
    assert [lr_factor(s, 10, "cosine", warmup_steps=2) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, 10, "cosine", warmup_steps=2) == 1.0
    assert lr_factor(6, 10, "cosine", warmup_steps=2) == pytest.approx(0.5)
    assert lr_factor(10, 10, "cosine", warmup_steps=2) == pytest.approx(0.0)
    assert lr_factor(7, 10, "constant") == 1.0
    with pytest.raises(ValueError, match="unknown schedule 'linear'"):
        lr_factor(1, 10, "linear")


def test_micro_batches_split_a_share_into_full_size_pieces() -> None:
    assert micro_batches(32, 21) == [(0, 21), (21, 32)]
    assert micro_batches(21, 21) == [(0, 21)]
    assert micro_batches(63, 21) == [(0, 21), (21, 42), (42, 63)]
    assert micro_batches(0, 21) == []


def test_the_run_stops_at_the_first_of_epochs_and_steps() -> None:
    settings = LoopSettings(
        global_batch_size=63, seed=0, max_steps=None, epochs=2, report_every_steps=1
    )
    assert total_steps(settings, 1000) == 32
    settings.max_steps = 20
    assert total_steps(settings, 1000) == 20


def test_grow_only_when_more_workers_fit() -> None:
    assert grow_target(2, 3, free_fit=1) == 3
    assert grow_target(2, 3, free_fit=5) == 3
    assert grow_target(2, 3, free_fit=0) is None
    assert grow_target(3, 3, free_fit=2) is None


def test_the_grace_period() -> None:
    assert not below_min_for_too_long(2.9, 3.0)
    assert below_min_for_too_long(3.1, 3.0)


def test_every_rank_runs_as_many_passes_as_the_largest_share_needs() -> None:
    # G=9, max_workers 8 (micro-batches of 2), 2 workers: shares of 5 and 4.
    assert passes_per_step(9, 2, 2) == 3
    assert micro_batch_plan(5, 2, 3) == [(0, 2), (2, 4), (4, 5)]
    assert micro_batch_plan(4, 2, 3) == [(0, 2), (2, 4), (0, 0)]
    # A last batch of 1 sample on 2 workers: rank 1's share is empty, it still runs one.
    assert passes_per_step(1, 2, 2) == 1
    assert micro_batch_plan(0, 2, 1) == [(0, 0)]
    assert passes_per_step(63, 3, 21) == 1 and passes_per_step(63, 2, 21) == 2
