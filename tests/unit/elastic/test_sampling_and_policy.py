from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.cluster.scheduling import workers_that_fit
from elastic.supervisor.policy import choose_world_size
from elastic.train.sampling import (
    SamplerPosition,
    advance,
    epoch_permutation,
    rank_indices,
    share,
    steps_per_epoch,
)


def test_shares_cover_the_batch_without_overlap() -> None:
    assert [share(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [share(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]


def test_the_permutation_is_seeded_per_epoch() -> None:
    a, b = epoch_permutation(100, 7, 0), epoch_permutation(100, 7, 1)
    assert sorted(a) == list(range(100))
    assert list(a) == list(epoch_permutation(100, 7, 0))
    assert list(a) != list(b)


def test_advance_rolls_over_at_the_end_of_an_epoch() -> None:
    assert advance(SamplerPosition(0, 0), 10, 4) == SamplerPosition(0, 4)
    assert advance(SamplerPosition(0, 8), 10, 4) == SamplerPosition(1, 0)
    assert steps_per_epoch(10, 4) == 3


@settings(max_examples=150, deadline=None)
@given(
    dataset=st.integers(1, 60),
    batch=st.integers(1, 16),
    segments=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), min_size=1, max_size=6),
)
def test_any_resizes_and_stops_see_each_sample_once_per_epoch(
    dataset: int, batch: int, segments: list[tuple[int, int]]
) -> None:
    """Run segments of (world size, steps), each restarting from the position the previous
    one stopped at, as a job resized at checkpoint boundaries would."""
    seen: Counter[tuple[int, int]] = Counter()
    position = SamplerPosition()
    for world, steps in segments:
        streams = [rank_indices(position, dataset, batch, 3, world, r) for r in range(world)]
        for _ in range(steps):
            outs = [next(s) for s in streams]
            pos = outs[0][0]
            assert all(o[0] == pos for o in outs)  # the ranks agree on where they are
            assert sum(len(o[1]) for o in outs) == outs[0][2]
            for o in outs:
                for i in o[1]:
                    seen[(pos.epoch, i)] += 1
            position = advance(pos, dataset, batch)
    assert all(n == 1 for n in seen.values())
    finished = {e for e, _ in seen if e < position.epoch}
    for epoch in finished:
        assert {i for e, i in seen if e == epoch} == set(range(dataset))


def test_workers_fit_within_single_nodes() -> None:
    nodes = [{"CPU": 3.0}, {"CPU": 1.5, "GPU": 2.0}, {"GPU": 4.0}]
    assert workers_that_fit(nodes, {"CPU": 1.0}) == 4
    assert workers_that_fit(nodes, {"CPU": 1.0, "GPU": 1.0}) == 1
    assert workers_that_fit(nodes, {"CPU": 2.0}) == 1
    assert workers_that_fit([], {"CPU": 1.0}) == 0


def test_choose_the_largest_size_that_fits() -> None:
    assert choose_world_size(1, 3, 5) == 3
    assert choose_world_size(1, 3, 2) == 2
    assert choose_world_size(2, 3, 1) is None


def test_restarts_are_counted_per_cause_and_forgiven_by_progress() -> None:
    from elastic.supervisor.attempt import EndCause
    from elastic.supervisor.policy import RestartPolicy

    policy = RestartPolicy(max_restarts=1, node_loss_limit=2, start_failure_limit=1)
    assert policy.decide(EndCause.ERROR, progressed=False).retry
    # Node losses have their own budget: they do not use up max_restarts.
    assert policy.decide(EndCause.NODE_LOST, progressed=False).retry
    assert policy.decide(EndCause.NODE_LOST, progressed=False).retry
    third = policy.decide(EndCause.NODE_LOST, progressed=False)
    assert not third.retry and third.reason == (
        "gave up after 2 node losses in a row without a checkpoint; the limit is 2"
    )
    # An attempt that saved a checkpoint forgives everything before it.
    assert policy.decide(EndCause.ERROR, progressed=True).retry
    assert policy.restarts == 0
    assert policy.decide(EndCause.ERROR, progressed=False).retry
    second = policy.decide(EndCause.ERROR, progressed=False)
    assert not second.retry and second.reason == "gave up after 1 restart; max_restarts is 1"
    assert policy.decide(EndCause.START_TIMEOUT, progressed=False).retry
    assert not policy.decide(EndCause.START_TIMEOUT, progressed=False).retry
