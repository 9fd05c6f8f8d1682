"""An in-place replica's step loop (``InPlaceContext.batches`` and ``train_step``), on one
process without Ray: torchft's manager is scripted, quorum by quorum, so each test says
which steps commit, who is in the quorum and where this replica stands in it. The model,
the data, the sampler, the schedule and the checkpoints are the product's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.events import EventKind
from elastic.in_place.context import InPlaceContext, LeftTheQuorum
from elastic.in_place.steps import participant_indices
from elastic.train.sampling import SamplerPosition, epoch_permutation
from elastic.train.worker import WorkerContext
from elastic.train.worker_config import WorkerConfig

ROWS, BATCH, SEED = 64, 8, 3


class DoneWork:
    """A collective that completed: the replica's world is one process."""

    def wait(self) -> bool:
        return True


class ScriptedManager:
    """torchft's ``Manager`` as the step loop uses it. Each quorum takes the next
    ``(participants, rank, commits)`` of the script (the last one repeats). The all-reduce
    leaves the tensor as it is: with one participant the sum over the quorum is its own."""

    def __init__(
        self,
        script: Sequence[tuple[int, int | None, bool]],
        heals: dict[int, Callable[[], dict[str, Any]]] | None = None,
    ) -> None:
        """``heals``: by quorum number (from 0), the peer's heal state that quorum loads."""
        self.script = script
        self.heals = heals or {}
        self.quorums = 0
        self.current = script[0]
        self.errors: list[Exception] = []
        self.load: Callable[[dict[str, Any]], None] | None = None
        self.save: Callable[[], dict[str, Any]] | None = None

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state

    def start_quorum(self) -> None:
        heal = self.heals.get(self.quorums)
        if heal is not None:
            assert self.load is not None
            self.load(heal())
        self.current = self.script[min(self.quorums, len(self.script) - 1)]
        self.quorums += 1

    def num_participants(self) -> int:
        return self.current[0]

    def participating_rank(self) -> int | None:
        return self.current[1]

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> DoneWork:
        return DoneWork()

    def should_commit(self) -> bool:
        return self.current[2]

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)


def replica(tmp_path: Path, manager: ScriptedManager, must_heal: bool = False) -> InPlaceContext:
    config = WorkerConfig(str(tmp_path / "ckpt"), every_steps=1000, keep=2, max_workers=2)
    worker = WorkerContext(rank=0, world_size=1, config=config, supervisor=None)

    def factory(load: Any, save: Any) -> ScriptedManager:
        manager.load, manager.save = load, save
        return manager

    return InPlaceContext({"hyperparameters": {}}, worker, factory, replica=0, must_heal=must_heal)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.5)


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).sum(dim=1)


def train(ctx: InPlaceContext, max_steps: int) -> tuple[list[int], list[list[int]]]:
    """The user's loop: returns the steps it was handed (a redone step twice) and each
    batch's indices."""
    torch.manual_seed(SEED)
    model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    steps, indices = [], []
    batches: Iterator[Any] = ctx.batches(
        data(), BATCH, max_steps=max_steps, seed=SEED, lr_schedule="cosine"
    )
    for batch in batches:
        steps.append(batch.step)
        indices.append(list(batch.indices))
        ctx.train_step(batch, squared_error)
    return steps, indices


def metrics_steps(ctx: InPlaceContext) -> list[int]:
    return [d["step"] for k, d in ctx.worker.local_events if k == EventKind.METRICS]


def parameters(ctx: InPlaceContext) -> list[torch.Tensor]:
    assert ctx.model is not None
    return [p.detach().clone() for p in ctx.model.parameters()]


def test_a_step_not_committed_is_redone_whole_and_the_model_is_as_if_it_never_failed(
    tmp_path: Path,
) -> None:
    """Steps 3 and 5 fail their commit once (a peer lost mid-step): each is handed to the
    loop again with the same samples, and the float64 model after 6 steps is bit for bit
    the one of a run without failures; every step is reported once."""
    clean = replica(tmp_path / "clean", ScriptedManager([(1, 0, True)]))
    clean_steps, clean_indices = train(clean, 6)

    script = [(1, 0, True)] * 2 + [(1, 0, False), (1, 0, True), (1, 0, True)]
    script += [(1, 0, False), (1, 0, True), (1, 0, True)]
    failing = replica(tmp_path / "failing", ScriptedManager(script))
    steps, indices = train(failing, 6)

    assert clean_steps == [1, 2, 3, 4, 5, 6]
    assert steps == [1, 2, 3, 3, 4, 5, 5, 6]
    assert indices[2] == indices[3] == clean_indices[2]
    assert indices[5] == indices[6] == clean_indices[4]
    assert failing.step == clean.step == 6
    for a, b in zip(parameters(failing), parameters(clean), strict=True):
        assert torch.equal(a, b)
    assert metrics_steps(failing) == metrics_steps(clean) == [1, 2, 3, 4, 5, 6]


def test_each_participant_takes_its_share_of_the_global_batch_and_an_outsider_none(
    tmp_path: Path,
) -> None:
    """In a quorum of two, rank 1 trains the second part of each global batch; a replica
    the quorum left out (no rank: it heals, or it is late) trains no sample and reports
    nothing, and its rank is past the participants'."""
    ctx = replica(tmp_path / "member", ScriptedManager([(2, 1, True)]))
    _, indices = train(ctx, 2)
    perm = epoch_permutation(ROWS, SEED, 0)
    first, _ = participant_indices(perm, SamplerPosition(0, 0), ROWS, BATCH, 2, 1)
    second, _ = participant_indices(perm, SamplerPosition(0, BATCH), ROWS, BATCH, 2, 1)
    assert indices == [first, second]
    assert len(first) == BATCH // 2 and set(first) <= {int(i) for i in perm[:BATCH]}
    assert ctx.participants == 2 and ctx.worker.rank == 1 and metrics_steps(ctx) == []

    outsider = replica(tmp_path / "outsider", ScriptedManager([(2, None, True)]))
    _, indices = train(outsider, 2)
    assert indices == [[], []] and outsider.worker.rank == 2 and outsider.step == 2


def test_a_replica_that_becomes_the_reporter_sends_the_previous_report_first(
    tmp_path: Path,
) -> None:
    """The quorum's rank 0 reports; when it dies right after a commit, its report of that
    step may be lost with it. The replica that is rank 0 next sends the last step's report
    again before its own (the supervisor drops a step it already has)."""
    ctx = replica(tmp_path, ScriptedManager([(2, 1, True), (2, 1, True), (1, 0, True)]))
    train(ctx, 4)
    assert metrics_steps(ctx) == [2, 3, 4]
    reports = [d for k, d in ctx.worker.local_events if k == EventKind.METRICS]
    assert [r["world_size"] for r in reports] == [2, 1, 1]  # the quorum's participants


def test_a_step_healed_past_is_reported_by_the_next_reporter(tmp_path: Path) -> None:
    """A peer was lost in step 2's all-reduce: the all-reduce of this replica (rank 0, the
    reporter) was cut, rank 1's had completed, so rank 1 committed step 2 and, not being
    the reporter, did not report it. This replica heals to step 2 from rank 1, and rank 1's
    last report comes with the heal: it is sent before this replica's report of step 3."""
    peer = replica(tmp_path / "peer", ScriptedManager([(2, 1, True)]))
    train(peer, 2)
    assert metrics_steps(peer) == [] and peer.step == 2
    assert peer.manager is not None and peer.manager.save is not None
    healed = replica(
        tmp_path / "healed",
        ScriptedManager([(2, 0, True), (2, 0, False), (1, 0, True)], heals={2: peer.manager.save}),
    )
    steps, _ = train(healed, 3)
    assert steps == [1, 2, 3]  # step 2 discarded, then healed past
    assert healed.step == 3 and metrics_steps(healed) == [1, 2, 3]
    reports = [d for k, d in healed.worker.local_events if k == EventKind.METRICS]
    assert reports[1] == {"attempt": 1, **(peer._last_report or {})}


def test_a_replica_that_must_heal_never_trains_alone(tmp_path: Path) -> None:
    ctx = replica(tmp_path, ScriptedManager([(1, 0, True)]), must_heal=True)
    with pytest.raises(RuntimeError, match="found no healthy peer to heal from"):
        train(ctx, 3)
    assert ctx.step == 0


def test_a_draining_replica_leaves_at_a_step_boundary(tmp_path: Path) -> None:
    """Its node drains: it finishes the step in hand and leaves before the next quorum."""
    ctx = replica(tmp_path, ScriptedManager([(1, 0, True)]))
    torch.manual_seed(SEED)
    model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(LeftTheQuorum) as left:
        for batch in ctx.batches(data(), BATCH, max_steps=6, seed=SEED):
            ctx.train_step(batch, squared_error)
            if batch.step == 2:
                ctx.leaving.set()
    assert left.value.step == 2 and ctx.step == 2


# -- the loop's own forward pass, and worker processes ----------------------------------------


def own_forward(ctx: InPlaceContext, **loading: Any) -> tuple[list[Any], list[list[int]]]:
    """The user's loop with its own forward pass and a hook before each optimizer step:
    what each step returned, and each batch's indices."""
    torch.manual_seed(SEED)
    model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    returned: list[Any] = []
    indices: list[list[int]] = []
    hooked: list[int] = []
    batches = ctx.batches(data(), BATCH, max_steps=6, seed=SEED, lr_schedule="cosine", **loading)
    for batch in batches:
        indices.append(list(batch.indices))
        loss = ctx.train_step(
            batch,
            forward=lambda m: squared_error(model(m.inputs), m.targets),
            before_step=lambda step=batch.step: hooked.append(step),
        )
        returned.append(loss)
    ctx.state["hooked"] = hooked
    return returned, indices


def test_the_loop_s_own_forward_trains_as_the_context_s_and_returns_the_quorum_s_mean(
    tmp_path: Path,
) -> None:
    """Bit for bit the model of ``train_step(batch, loss_per_sample)``; each committed step
    returns its mean loss over the global batch, a discarded one None, and the hook runs
    once per committed step."""
    clean = replica(tmp_path / "clean", ScriptedManager([(1, 0, True)]))
    train(clean, 6)
    script = [(1, 0, True)] * 2 + [(1, 0, False), (1, 0, True)]
    own = replica(tmp_path / "own", ScriptedManager(script))
    returned, _ = own_forward(own)

    for a, b in zip(parameters(own), parameters(clean), strict=True):
        assert torch.equal(a, b)
    assert returned[2] is None and len(returned) == 7
    reported = [d["loss"] for k, d in own.worker.local_events if k == EventKind.METRICS]
    assert [r for r in returned if r is not None] == reported
    assert own.state["hooked"] == [1, 2, 3, 4, 5, 6]


def test_the_returned_loss_is_the_mean_over_the_step_s_samples(tmp_path: Path) -> None:
    ctx = replica(tmp_path, ScriptedManager([(1, 0, True)]))
    x, y = data().tensors
    torch.manual_seed(SEED)
    model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in ctx.batches(data(), BATCH, max_steps=3, seed=SEED):
        with torch.no_grad():
            by_hand = float(squared_error(model(x[batch.indices]), y[batch.indices]).mean())
        loss = ctx.train_step(batch, forward=lambda m: squared_error(model(m.inputs), m.targets))
        assert loss == pytest.approx(by_hand, rel=1e-13, abs=0)


def test_worker_processes_read_each_step_s_samples_as_the_replica_itself_does(
    tmp_path: Path,
) -> None:
    """The quorum grows from 1 to 2 at step 3 (this replica is its rank 1): the samples of
    each step are those its quorum chose, read by worker processes or not."""
    script = [(1, 0, True)] * 2 + [(2, 1, True)]
    alone = replica(tmp_path / "alone", ScriptedManager(script))
    _, alone_indices = own_forward(alone)
    workers = replica(tmp_path / "workers", ScriptedManager(script))
    _, worker_indices = own_forward(workers, num_workers=2)
    assert worker_indices == alone_indices
    assert len(alone_indices[0]) == BATCH and len(alone_indices[2]) == BATCH // 2
    for a, b in zip(parameters(workers), parameters(alone), strict=True):
        assert torch.equal(a, b)


def epochs_trained(ctx: InPlaceContext, epochs: int, per_epoch_loader: bool) -> list[list[int]]:
    """A loop written per epoch: an epoch function over ``ctx.loader`` (one epoch per
    ``for``), or over ``ctx.batches`` returning at ``batch.ends_epoch``. Returns each
    epoch's steps as the loop saw them (a redone step twice)."""
    torch.manual_seed(SEED)
    model = ctx.prepare_model(nn.Linear(4, 1, dtype=torch.float64))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    steps: Any
    if per_epoch_loader:
        steps = ctx.loader(data(), BATCH, epochs=epochs, seed=SEED)
    else:
        steps = ctx.batches(data(), BATCH, epochs=epochs, seed=SEED)
    seen: list[list[int]] = []
    for _ in range(epochs):
        seen.append([])
        for batch in steps:
            seen[-1].append(batch.step)
            ctx.train_step(batch, squared_error)
            if not per_epoch_loader and batch.ends_epoch:
                break
    ctx.finish_steps()
    return seen


@pytest.mark.parametrize("per_epoch_loader", [False, True])
def test_a_discarded_last_step_of_an_epoch_does_not_end_the_epoch(
    tmp_path: Path, per_epoch_loader: bool
) -> None:
    """Step 8 ends epoch 0 (8 steps an epoch) and fails its commit once: the epoch goes on to
    its redo, and the loop trains both epochs whole, its model the one of a run without
    the failure."""
    clean = replica(tmp_path / "clean", ScriptedManager([(1, 0, True)]))
    assert epochs_trained(clean, 2, per_epoch_loader) == [
        list(range(1, 9)),
        list(range(9, 17)),
    ]
    script = [(1, 0, True)] * 7 + [(1, 0, False), (1, 0, True)]
    failing = replica(tmp_path / "failing", ScriptedManager(script))
    seen = epochs_trained(failing, 2, per_epoch_loader)
    assert seen == [[*range(1, 9), 8], list(range(9, 17))]
    assert failing.step == 16
    for a, b in zip(parameters(failing), parameters(clean), strict=True):
        assert torch.equal(a, b)
