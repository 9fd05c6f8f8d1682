"""The training context of an in-place replica: the same ``train_loop(config, ctx)`` API as
:class:`elastic.train.context.TrainContext`, with every step taken by whichever replicas the torchft
quorum holds at that step.

Each replica is a world of one for ``torch.distributed`` (no DDP wrapper): its only
collective is the manager's fault-tolerant all-reduce of the step's gradients. A step whose
all-reduce or commit fails is discarded and redone whole by the next quorum; a replica that
joins heals from a peer (model, optimizer, schedule, step, sampler position) at the quorum.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from elastic.checkpoint.parts import RankRng, seed_rank
from elastic.events import EventKind
from elastic.in_place.abort import StepAbort
from elastic.in_place.buckets import GradientBuckets
from elastic.in_place.members import quorum_members
from elastic.in_place.steps import (
    QuorumChange,
    Timeline,
    loss_weight,
    participant_indices,
    quorum_events,
)
from elastic.train import mlflow_log
from elastic.train.context import (
    BeforeStep,
    LoopSettings,
    LossPerSample,
    StepBatch,
    TrainContext,
    micro_batches,
    tracked_steps,
)
from elastic.train.micro_batch import Forward, map_tensors, micro_batch, split_batch
from elastic.train.sampling import SamplerPosition, advance, epoch_permutation
from elastic.train.step_loader import LoaderOptions, StepReader, keys
from elastic.train.tensorboard import TensorBoardLog

SUM = torch.distributed.ReduceOp.SUM


class LeftTheQuorum(Exception):
    """Raised out of ``ctx.batches`` at a step boundary when this replica's node is draining:
    it leaves the quorum, the others train on without it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"left the quorum after step {step} (its node is draining)")
        self.step = step


class InPlaceContext(TrainContext):
    """``manager_factory(load, save)`` builds this replica's torchft ``Manager`` once the
    loop's parts are registered (the heal state is theirs)."""

    def __init__(
        self,
        config: dict[str, Any],
        worker: Any,
        manager_factory: Callable[[Callable[[Any], None], Callable[[], Any]], Any],
        replica: int,
        must_heal: bool = False,
        start_together: Callable[[], None] | None = None,
        tell_trained: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config, worker)
        # How its first committed step reaches the supervisor when the worker holds no link
        # to it (a package loop's confined child: its actor calls for it).
        self.tell_trained = tell_trained
        # Called once the manager heartbeats: waits for the attempt's other starting replicas.
        self.start_together = start_together
        # A replacement or a late joiner: it must find a healthy peer to heal from, and never
        # trains on alone from its own (older) state.
        self.must_heal = must_heal
        self.manager_factory = manager_factory
        self.manager: Any = None
        self.replica = replica
        self.timeline = Timeline()
        self._committed = False
        self._participants = 1
        # Set from another thread when the supervisor hears that a peer is gone.
        self.abort = StepAbort()
        # Set from another thread when this replica's node is draining: leave at the next
        # step boundary (with a checkpoint of that step when no other replica stays).
        self.leaving = threading.Event()
        self.save_on_leave = False
        self._logs_open = False
        self._told_trained = False
        self._buckets: GradientBuckets | None = None  # built at the first step
        self._last_report: dict[str, Any] | None = None
        self._reporter = False  # whether it was the quorum's rank 0 at its last report

    @property
    def participants(self) -> int:
        """How many replicas train the current step (its quorum's size). ``world_size`` stays
        1 in place: each replica is a world of its own, and evaluates on its own."""
        return self._participants

    # -- the heal state: every replicated checkpoint part, and the last report ---------------

    def _heal_state(self) -> dict[str, Any]:
        return {"parts": self.checkpoints.state.replicated_state(), "report": self._last_report}

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        """The healer's last report comes along: the step healed past may have been committed
        only by replicas that were not its quorum's rank 0 (this one's all-reduce was cut by
        a lost peer, theirs had completed), while rank 0 was lost with its report. Whichever
        replica is rank 0 next then sends it again (a repeat is dropped by the supervisor)."""
        for name, part in self.checkpoints.state.replicated.items():
            if name in state["parts"]:
                part.load_state_dict(state["parts"][name])
        self._last_report = state["report"]
        self._reporter = False

    # -- the steps ---------------------------------------------------------------------------

    @tracked_steps
    def _steps(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        *,
        epochs: int | None = None,
        max_steps: int | None = None,
        seed: int = 0,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        report_every_steps: int = 1,
        record_samples: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
    ) -> Iterator[StepBatch | None]:
        """As ``TrainContext._steps``, each step's samples chosen by the quorum that trains
        it. Worker processes (``num_workers``) read a step's samples in parallel once its
        quorum has chosen them, never ahead, and live as long as the loop, whatever
        ``persistent_workers`` says."""
        loading = LoaderOptions(num_workers, pin_memory, persistent_workers, prefetch_factor)
        settings = LoopSettings(
            global_batch_size,
            seed,
            max_steps,
            epochs,
            report_every_steps,
            lr_schedule,
            warmup_steps,
            record_samples,
        )
        dataset_size = len(dataset)  # type: ignore[arg-type]
        last_step = self._begin_steps(settings, dataset_size)
        assert self.model is not None
        rng = RankRng(self.replica, seed, lambda: self.step, self.checkpoints.gather)
        self.checkpoints.state.register("rng", rng)
        reader = StepReader(dataset, collate_fn or default_collate, loading, self.device)
        samples = _CommittedSamples(self.worker, self.replica, record_samples)
        self.manager = self.manager_factory(self._load_heal_state, self._heal_state)
        # torchft counts committed steps itself: it starts where this replica's state is, so
        # a replica resumed from a checkpoint is not healed back, and a joiner behind is.
        self.manager.load_state_dict({"step": self.step, "batches_committed": 0})
        if self.start_together is not None and not self.must_heal:
            self.start_together()
        perm_epoch, perm = -1, None
        self.model.train()
        # samples/s between two reports on this replica's clock, pauses and redone steps
        # included: what the job really trained at.
        window_start, window_samples = time.perf_counter(), 0
        while self.step < last_step:
            if self.leaving.is_set():
                self._leave()
            self.abort.new_step()
            self.manager.start_quorum()  # may heal this replica: step and position move
            if self.step >= last_step:
                break
            participants = self.manager.num_participants()
            rank = self.manager.participating_rank()
            if self.must_heal and participants < 2:
                raise RuntimeError(
                    f"replica {self.replica} found no healthy peer to heal from; it does "
                    f"not train on alone from step {self.step}"
                )
            # The quorum's rank 0 writes checkpoints and reports, as rank 0 does elsewhere.
            self.worker.rank = rank if rank is not None else participants
            self._participants = participants
            if self.worker.rank == 0:
                self._open_logs(participants)
            elif self._logs_open:
                self._hand_off_logs()
            # Randomness of a step depends on (seed, rank in the quorum, step) only: the
            # same after a heal, a redo or a resize.
            seed_rank(seed, self.worker.rank, self.step)
            position = self.position
            if position.epoch != perm_epoch:
                perm_epoch, perm = (
                    position.epoch,
                    epoch_permutation(dataset_size, seed, position.epoch),
                )
            assert perm is not None
            indices: list[int]
            if rank is None:
                indices, global_batch = [], min(global_batch_size, dataset_size)
            else:
                indices, global_batch = participant_indices(
                    perm, position, dataset_size, global_batch_size, participants, rank
                )
            inputs, targets = split_batch(reader.read(keys(position.epoch, indices or [0])))
            after = advance(position, dataset_size, global_batch_size)
            batch = StepBatch(
                step=self.step + 1,
                epoch=position.epoch,
                inputs=map_tensors(inputs, lambda t: t.to(self.device)),
                targets=map_tensors(targets, lambda t: t.to(self.device)),
                global_batch=global_batch,
                indices=indices,
                ends_epoch=after.epoch != position.epoch,
            )
            self._committed = False
            yield batch
            if not self._committed:
                if self._trained == batch.step:
                    raise RuntimeError("unreachable: a trained step was not committed")
                self.timeline.failed(time.time())
                continue  # redone whole by the next quorum
            self.step = self.worker.completed_step = batch.step
            self.position = after
            # Healed, or in step with its peers: only a committed step shows it. A heal cut
            # short (its sender lost) leaves this replica's own, older state.
            self.must_heal = False
            if not self._told_trained:
                self._told_trained = True
                self._tell_trained()
            window_samples += global_batch
            if batch.ends_epoch and self.worker.rank == 0:
                # The job's log says where it is, for the dashboard's log pane.
                print(
                    f"[elastic-train] epoch {position.epoch} ended at step {self.step} "
                    f"({participants} worker{'s' if participants > 1 else ''})",
                    flush=True,
                )
            samples.write(self.step, position.epoch, perm, position, dataset_size, global_batch)
            members = quorum_members(self.manager)
            change = self.timeline.committed(self.step, participants, time.time(), members)
            if change is not None and self.worker.rank == 0:
                self._announce(change)
            if self.step in (1, last_step) or self.step % report_every_steps == 0:
                elapsed = time.perf_counter() - window_start
                self._report(last_step, window_samples / elapsed if elapsed > 0 else None)
                window_start, window_samples = time.perf_counter(), 0
            if self.step % self.worker.every_steps == 0 or self.step == last_step:
                self.checkpoints.save(self.step)
                if self.step == last_step:
                    self.checkpoints.wait()
            if batch.ends_epoch:
                yield None

    def _tell_trained(self) -> None:
        """Its first committed step: the supervisor now counts it a survivor whose training
        a fast fence of a silent peer protects (elastic/in_place/watchdog.py)."""
        if self.tell_trained is not None:
            self.tell_trained()
            return
        supervisor = self.worker.supervisor
        if supervisor is not None:
            supervisor.replica_trained.remote(self.worker.config.attempt, self.replica)

    def _announce(self, change: QuorumChange) -> None:
        for kind, data in quorum_events(change):
            self.worker.emit(kind, data)

    def _leave(self) -> None:
        if self.save_on_leave and self.worker.rank == 0:
            # The last replica standing: what it trained is kept for the next attempt.
            self.checkpoints.save(self.step)
        self.checkpoints.wait()
        raise LeftTheQuorum(self.step)

    def _open_logs(self, participants: int) -> None:
        """TensorBoard and MLflow are written by the quorum's rank 0: the first time this
        replica is it, it opens its own event file and its share of the job's MLflow run. A
        package loop's child writes TensorBoard only: it holds no MLflow credentials, and its
        config no MLflow part."""
        reports = self.worker.supervisor is not None or self.tell_trained is not None
        if self._logs_open or not reports:
            return
        self._logs_open = True
        meta = self.worker.config
        self.worker.tensorboard = TensorBoardLog(
            meta.checkpoint_dir, meta.attempt, participants, self.step, f".replica{self.replica}"
        )
        self.worker.mlflow = mlflow_log.for_worker(
            self.config, meta.attempt, participants, self.step
        )

    def _hand_off_logs(self) -> None:
        """No longer the quorum's rank 0 (a replica below it joined): the points written so
        far reach the disk and the run now, before the job's end may kill this process."""
        tensorboard, mlflow = self.worker.tensorboard, self.worker.mlflow
        self.worker.tensorboard = self.worker.mlflow = None
        self._logs_open = False

        def close() -> None:
            for log in (tensorboard, mlflow):
                if log is not None:
                    log.close()

        threading.Thread(target=close, name="etrain-logs-hand-off", daemon=True).start()

    def evaluate(
        self,
        dataset: Dataset[Any],
        loss_per_sample: LossPerSample | None = None,
        batch_size: int = 256,
    ) -> dict[str, float]:
        """Each replica evaluates the whole held-out set on its own: a replica is a world of
        one, every replica holds the same model, and no collective outside the quorum's
        all-reduce can lose a peer."""
        rank = self.worker.rank
        self.worker.rank = 0
        try:
            return super().evaluate(dataset, loss_per_sample, batch_size)
        finally:
            self.worker.rank = rank

    def train_step(
        self,
        batch: StepBatch,
        loss_per_sample: LossPerSample | None = None,
        *,
        forward: Forward | None = None,
        before_step: BeforeStep | None = None,
    ) -> float | None:
        """As ``TrainContext.train_step``; ``before_step`` runs only on a step that commits,
        on the quorum's summed gradients. Returns None for a step discarded (a peer of it
        lost): the next quorum redoes it whole."""
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None
        assert self.manager is not None
        run = self._forward_pass(loss_per_sample, forward)
        inputs = self._cast(batch.inputs)
        if self._buckets is None:
            self._buckets = GradientBuckets([p for p in model.parameters() if p.requires_grad])
        buckets, manager = self._buckets, self.manager

        def launch(flat: torch.Tensor) -> Any:
            return manager.allreduce(flat, reduce_op=SUM)

        optimizer.zero_grad(set_to_none=False)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        weight = loss_weight(batch.global_batch)
        # The sum over the quorum of every bucket is the global batch's mean gradient.
        passes = micro_batches(batch.real, self._micro)
        for n, (a, b) in enumerate(passes):
            if n == len(passes) - 1:
                buckets.arm(launch)
            with self.precision.autocast():
                losses, right = run(micro_batch(inputs, batch.targets, a, b, padding=False))
            if right is not None:
                totals[1] += right
            totals[0] += losses.detach().double().sum()
            self.precision.backward(losses.sum() * weight)
        if not passes:
            buckets.arm(launch)
        works = [*buckets.launch_rest(), launch(totals)]
        if not self.abort.wait_all(works, self.manager):
            buckets.renew()  # the abandoned all-reduce keeps the old buffers
            return self._discard(batch)  # a peer of this step is gone
        if not self.manager.should_commit():
            return self._discard(batch)
        self.checkpoints.before_update()  # the hook may write what the snapshot copies
        self._before_step(before_step)
        self.precision.step(optimizer)
        if self.scheduler is not None:  # the loop's own, if any, it steps itself
            self.scheduler.step()
        self._totals = totals
        self._counts_accuracy = forward is None
        self._step_global_batch = batch.global_batch
        self._trained = batch.step
        self._committed = True
        return float(totals[0]) / batch.global_batch

    @staticmethod
    def _discard(batch: StepBatch) -> None:
        """A step discarded is redone whole by the next quorum: it ended no epoch, so a
        loop that returns at ``batch.ends_epoch`` stays for the redo."""
        batch.ends_epoch = False

    def _report(self, last_step: int, samples_per_s: float | None) -> bool:
        """The quorum's rank 0 reports the step. Every replica builds the report, since the
        quorum's totals are the same on all: one that becomes the reporter sends the previous
        report again first, as its reporter may have died with it in flight (the supervisor
        drops a step it already has). In place a drain is not acted on here (the quorum goes
        on without the node)."""
        report = self._metrics(
            self._totals,
            last_step,
            samples_per_s,
            self._participants,
            longest_pause_s=round(self.timeline.longest_pause, 4),
        )
        self._extra_metrics = {}
        previous, self._last_report = self._last_report, report
        was_reporter, self._reporter = self._reporter, self.worker.rank == 0
        if not self._reporter:
            return False
        if not was_reporter and previous is not None:
            self.worker.emit(EventKind.METRICS, previous)
        self.worker.emit(EventKind.METRICS, report)
        return False


class _CommittedSamples:
    """Every committing replica writes the whole step's indices: a replica that died after
    the all-reduce (its share was in the committed gradient) leaves no gap in the audit.
    The audit takes one record per step."""

    def __init__(self, worker: Any, replica: int, enabled: bool) -> None:
        self.file = None
        self.attempt = worker.attempt
        if enabled:
            folder = Path(worker.checkpoints.root) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"attempt-{worker.attempt}-replica-{replica}.jsonl"
            self.file = (folder / name).open("a")

    def write(
        self,
        step: int,
        epoch: int,
        perm: Any,
        position: SamplerPosition,
        dataset_size: int,
        global_batch: int,
    ) -> None:
        if self.file is None:
            return
        end = min(position.consumed + global_batch, dataset_size)
        indices = [int(i) for i in perm[position.consumed : end]]
        self.file.write(json.dumps({"a": self.attempt, "s": step, "e": epoch, "i": indices}))
        self.file.write("\n")
        self.file.flush()


def manager_timeout(collective_timeout_s: int) -> timedelta:
    return timedelta(seconds=collective_timeout_s)
