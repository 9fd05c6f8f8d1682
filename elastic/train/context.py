"""The training context every training loop runs with inside a worker: built-in workloads
and users' ``train_loop(config, ctx)`` alike.

A loop hands the context its model, optimizer and dataset; the context supplies what makes
the job elastic and the training the same whatever the world size: the model made
distributed as the job's ``distributed`` options say, the resumable data order, the global
batch kept whole by gradient accumulation, checkpoints at fixed step boundaries, restore,
pausing at a checkpoint so the supervisor can grow the job, and metrics.

    model = ctx.prepare_model(Net())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in ctx.batches(dataset, global_batch_size=64, epochs=3):
        ctx.train_step(batch, nn.CrossEntropyLoss(reduction="none"))

or, with the loop's own forward pass and a hook before the optimizer step:

    def forward(micro: MicroBatch) -> torch.Tensor:  # one loss per sample
        out = model(**micro.inputs)
        return F.cross_entropy(out.logits, micro.inputs["labels"], reduction="none")

    for batch in ctx.batches(dataset, global_batch_size=64, epochs=3, num_workers=4):
        loss = ctx.train_step(batch, forward=forward,
                              before_step=lambda: clip_grad_norm_(model.parameters(), 1.0))
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypedDict, TypeVar, Unpack, overload

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from elastic.checkpoint.parts import (
    RankRng,
    ReplicatedModel,
    ReplicatedOptimizer,
    ShardedModel,
    ShardedOptimizer,
    Value,
)
from elastic.checkpoint.writer import CheckpointManager
from elastic.events import EventKind
from elastic.train.current import call_train_loop
from elastic.train.distributed import (
    DistributedOptions,
    LocalSGD,
    Precision,
    gradient_sync,
    is_sharded,
    unwrap,
    wrap_model,
)
from elastic.train.lr_schedule import lr_factor
from elastic.train.micro_batch import (
    Forward,
    MicroBatch,
    map_tensors,
    micro_batch,
    per_sample_losses,
    split_batch,
)
from elastic.train.process_group import (
    AttemptAbandoned,
    PendingAllReduce,
    all_reduce,
    start_all_reduce,
)
from elastic.train.sampling import (
    SamplerPosition,
    advance,
    rank_indices,
    sample_seed,
    share,
    steps_per_epoch,
)
from elastic.train.step_loader import EpochItems, Key, LoaderOptions, keys
from elastic.train.worker import WorkerContext

LossPerSample = Callable[[Any, torch.Tensor], torch.Tensor]
# Called once the step's gradients are final (combined across workers, weighted to the
# global batch's mean, unscaled) and before the optimizer step: clipping, penalties.
BeforeStep = Callable[[], Any]


class PausedForResize(BaseException):
    """Raised out of ``ctx.batches`` right after a checkpoint when the supervisor wants the
    job to restart bigger. A BaseException, so a user's ``except Exception`` lets it by."""


@dataclass
class LoopSettings:
    global_batch_size: int
    seed: int
    max_steps: int | None
    epochs: int | None
    report_every_steps: int = 1
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # Write the indices each rank trains on, per step, under the checkpoint dir (audits).
    record_samples: bool = False


@dataclass
class StepBatch:
    """This rank's part of one optimizer step's global batch, already on the device."""

    step: int  # the optimizer step this batch makes (1-based)
    epoch: int
    inputs: Any
    targets: Any  # None when the samples are not (inputs, targets) pairs (a dict, say)
    global_batch: int  # samples in the step across all ranks
    indices: list[int]  # this rank's samples (none when a short last batch left it none)
    ends_epoch: bool  # the last step of its epoch: a place for a held-out evaluation
    # Rows of ``inputs`` that are samples; an empty share holds one padding row instead
    # (the dataset's first sample, counted with weight zero).
    real: int = -1

    def __post_init__(self) -> None:
        if self.real < 0:
            self.real = len(self.indices)


class StepOptions(TypedDict, total=False):
    """The keyword options of ``ctx.batches`` and ``ctx.loader``: how many steps, the data
    order's seed, the built-in LR schedule, reports, the sample audit and the DataLoader's
    settings."""

    epochs: int | None
    max_steps: int | None
    seed: int
    lr_schedule: str
    warmup_steps: int
    report_every_steps: int
    record_samples: bool
    collate_fn: Callable[[list[Any]], Any] | None
    num_workers: int
    pin_memory: bool | None
    persistent_workers: bool
    prefetch_factor: int | None


class EpochLoader:
    """``ctx.loader``'s steps, one epoch per ``for``. A loop that leaves an epoch early
    (``break``) takes it up at its next step: no step is skipped."""

    def __init__(self, steps: Iterator[StepBatch | None]) -> None:
        self._steps = steps

    def __iter__(self) -> Iterator[StepBatch]:
        # The steps' generator lives on between epochs: a ``for`` ending here neither
        # closes it nor reads the next epoch's first batch.
        while (batch := next(self._steps, None)) is not None:
            yield batch


def total_steps(settings: LoopSettings, dataset_size: int) -> int:
    limits = []
    if settings.max_steps is not None:
        limits.append(settings.max_steps)
    if settings.epochs is not None:
        limits.append(settings.epochs * steps_per_epoch(dataset_size, settings.global_batch_size))
    if not limits:
        raise ValueError("give epochs or max_steps")
    return min(limits)


def micro_batches(share_size: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """[start, end) slices of a rank's share, each at most ``micro_batch_size``."""
    return [
        (i, min(i + micro_batch_size, share_size)) for i in range(0, share_size, micro_batch_size)
    ]


def passes_per_step(global_batch: int, world_size: int, micro_batch_size: int) -> int:
    """Forward/backward passes every rank runs for a step: as many as the largest share
    needs. FSDP gathers parameters in every pass and DDP arms its hooks in the last, so
    a rank with a smaller (or empty) share must still run them all."""
    largest_share = -(-global_batch // world_size)
    return max(1, -(-largest_share // micro_batch_size))


def micro_batch_plan(share_size: int, micro_batch_size: int, passes: int) -> list[tuple[int, int]]:
    """This rank's ``passes`` slices: its share's micro-batches, then padding passes
    (``(0, 0)``: one row run with weight zero) up to the count every rank runs."""
    slices = micro_batches(share_size, micro_batch_size)
    return slices + [(0, 0)] * (passes - len(slices))


class PerSampleRandom(Dataset[Any]):
    """A dataset whose items draw random numbers (augmentations), made to draw them from
    a generator of their own: item ``i`` of epoch ``e`` is seeded by (seed, e, i), so it is
    augmented the same way whichever rank loads it, at any world size, before and after
    a restore. ``ctx.batches`` tells it the epoch. Covers torch's generator (torchvision's
    transforms draw from it)."""

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Transparent for what a loop reads of its dataset (``classes``, ``samples``).
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, i: int) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, self.epoch, i))
            return self.dataset[i]


class _StepBatches(torch.utils.data.Sampler[list[Key]]):
    """Feeds the DataLoader this rank's items for each of ``steps`` optimizer steps from a
    position, each item as (epoch, index) (see ``elastic.train.step_loader``). Iterated in
    the main process, ahead of training when worker processes prefetch: ``plan`` queues
    what each batch is, in the order the batches come back."""

    def __init__(
        self,
        position: SamplerPosition,
        dataset_size: int,
        settings: LoopSettings,
        world_size: int,
        rank: int,
        steps: int,
    ) -> None:
        self.steps = steps
        self.position = position
        self.dataset_size = dataset_size
        self.settings = settings
        self.world_size = world_size
        self.rank = rank
        self.plan: list[tuple[SamplerPosition, list[int], int]] = []

    def __iter__(self) -> Iterator[list[Key]]:
        steps = rank_indices(
            self.position,
            self.dataset_size,
            self.settings.global_batch_size,
            self.settings.seed,
            self.world_size,
            self.rank,
        )
        # Bounded: prefetching workers would otherwise read past the run's last step.
        for _, (position, indices, batch) in zip(range(self.steps), steps, strict=False):
            self.plan.append((position, indices, batch))
            # An empty share still feeds the model one row (the dataset's first sample, at
            # weight zero), so this rank joins every collective of the step.
            yield keys(position.epoch, indices or [0])


class _SampleLog:
    def __init__(self, ctx: WorkerContext, enabled: bool) -> None:
        self.file = None
        self.attempt = ctx.attempt
        if enabled:
            folder = Path(ctx.checkpoints.root) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            self.file = (folder / f"attempt-{ctx.attempt}-rank-{ctx.rank}.jsonl").open("a")

    def write(self, step: int, epoch: int, indices: list[int]) -> None:
        if self.file is not None:
            self.file.write(
                json.dumps({"a": self.attempt, "s": step, "e": epoch, "i": indices}) + "\n"
            )
            self.file.flush()


_Context = TypeVar("_Context", bound="TrainContext")
_Args = ParamSpec("_Args")


def tracked_steps(
    batches: Callable[Concatenate[_Context, _Args], Iterator[StepBatch | None]],
) -> Callable[Concatenate[_Context, _Args], Iterator[StepBatch | None]]:
    """A context's step generator, kept, so that :meth:`TrainContext.finish_steps` can
    complete the bookkeeping of a step the loop trained and then left."""

    def kept(
        ctx: _Context, /, *args: _Args.args, **kwargs: _Args.kwargs
    ) -> Iterator[StepBatch | None]:
        steps = batches(ctx, *args, **kwargs)
        ctx._open_steps = steps
        return steps

    functools.update_wrapper(kept, batches)
    return kept


class TrainContext:
    """What ``train_loop(config, ctx)`` receives. See the module docstring and
    ``examples/custom_train_loop.py``."""

    def __init__(
        self,
        config: dict[str, Any],
        worker: WorkerContext,
        options: DistributedOptions | None = None,
    ) -> None:
        self.config = config
        self.hyperparameters: dict[str, Any] = dict(config.get("hyperparameters") or {})
        self.worker = worker
        self.options = options or DistributedOptions.from_dict(config.get("distributed"))
        self.precision = Precision(self.options.precision, worker.device)
        self.local_sgd = LocalSGD(self.options.local_sgd_period) if self.options.local_sgd else None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None  # ctx.batches'
        self.user_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.dtype: torch.dtype | None = None
        # What a loop wants back after a restore, saved with each checkpoint: tensors,
        # numbers, strings, and lists, tuples and dicts of them (checkpoints load with
        # ``weights_only=True``).
        self.state: dict[str, Any] = {}
        self.step = 0
        self.position = SamplerPosition()
        if worker.rank == 0:
            # Before anyone writes: what a writer killed mid-checkpoint left behind.
            worker.checkpoints.clean_orphans()
        self.checkpoints = CheckpointManager(worker, self._updated_in_step)
        parts = self.checkpoints.state
        parts.register("step", Value(lambda: self.step, self._set_step))
        parts.register(
            "sampler",
            Value(
                lambda: self.position.to_dict(),
                lambda d: setattr(self, "position", SamplerPosition.from_dict(d)),
            ),
        )
        parts.register(
            "user", Value(lambda: self.state, lambda d: setattr(self, "state", dict(d or {})))
        )
        parts.register(
            "grad_scaler", Value(self.precision.state_dict, self.precision.load_state_dict)
        )
        self._extra_metrics: dict[str, Any] = {}
        # Set on every rank alike (by ``evaluate``, a collective): report at this step.
        self._report_now = False
        self._trained: int | None = None
        self._open_steps: Iterator[StepBatch | None] | None = None  # the latest steps
        # The last step's loss sum and right answers over its global batch (all workers).
        self._totals = torch.zeros(2, dtype=torch.float64)
        self._counts_accuracy = True  # false after a step of the loop's own forward pass
        self._step_global_batch = 1  # the global batch of the step just taken
        self._final_step: int | None = None
        self._micro = 1

    def _updated_in_step(self) -> list[torch.Tensor]:
        """Tensors only the optimizer step writes (a forward writes BatchNorm's buffers,
        so those are not among them)."""
        if self.model is None or self.optimizer is None:
            return []
        tensors = [p.data for p in self.model.parameters()]
        for per_param in self.optimizer.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _set_step(self, step: int) -> None:
        self.step = self.worker.completed_step = int(step)

    @property
    def _restored(self) -> dict[str, Any] | None:
        return self.checkpoints.restored

    @property
    def _sharded_checkpoint(self) -> bool:
        # The strategy, not the wrapper: an FSDP job resumed on one worker (unwrapped)
        # still reads and writes the sharded layout.
        return self.options.strategy == "fsdp"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TrainContext:
        return cls(config, WorkerContext.from_config(config))

    @property
    def rank(self) -> int:
        return self.worker.rank

    @property
    def world_size(self) -> int:
        return self.worker.world_size

    @property
    def device(self) -> torch.device:
        return self.worker.device

    # -- preparing the parts -------------------------------------------------------------

    def prepare_model(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        """The model restored from the attempt's checkpoint, on this worker's device, and
        wrapped for data parallelism (DDP or FSDP, with the job's gradient compression).
        Build the optimizer from the returned model's parameters."""
        if dtype is not None:
            model = model.to(dtype)
        self.dtype = dtype or next((p.dtype for p in model.parameters()), torch.float32)
        if self._sharded_checkpoint:
            # Sharded: wrapped first, then each rank loads the pieces of its shards.
            self.model = wrap_model(model, self.options, self.device)
            self.checkpoints.state.register("model", ShardedModel(self.model), sharded=True)
        else:
            # Loaded whole before DDP's wrapper broadcasts rank 0's copy.
            self.checkpoints.state.register("model", ReplicatedModel(model))
            self.model = wrap_model(model, self.options, self.device)
        return self.model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer, its state restored from the attempt's checkpoint."""
        if self.model is None:
            raise RuntimeError(
                "call ctx.prepare_model first: the optimizer must hold the "
                "prepared model's parameters"
            )
        if self._sharded_checkpoint:
            part: Any = ShardedOptimizer(self.model, optimizer)
            self.checkpoints.state.register("optimizer", part, sharded=True)
        else:
            self.checkpoints.state.register("optimizer", ReplicatedOptimizer(optimizer))
        self.optimizer = optimizer
        return optimizer

    def prepare_scheduler(
        self, scheduler: torch.optim.lr_scheduler.LRScheduler
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """The loop's own LR scheduler (``StepLR``, ``OneCycleLR``, ...), built on the
        prepared optimizer and stepped where the loop steps it (per epoch, per step): saved
        with each checkpoint and restored with it, so a resumed or resized run goes on with
        the same rates. With one, ``ctx.batches`` sets no rate of its own."""
        if scheduler.optimizer is not self.optimizer:
            raise ValueError("build the scheduler on the optimizer ctx.prepare_optimizer returned")
        self.user_scheduler = scheduler
        self.checkpoints.state.register(
            "user_scheduler", Value(scheduler.state_dict, scheduler.load_state_dict)
        )
        return scheduler

    @overload
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]: ...

    @overload
    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]: ...

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> tuple[Any, ...]:
        """``prepare_model``, ``prepare_optimizer`` and ``prepare_scheduler`` in one call, on
        parts a script built as it always did (the optimizer on the model's parameters, the
        scheduler on the optimizer): ``model, optimizer = ctx.prepare(model, optimizer)``."""
        held = [id(p) for group in optimizer.param_groups for p in group["params"]]
        if not set(held) <= {id(p) for p in model.parameters()}:
            raise ValueError("ctx.prepare: the optimizer must be built on the model's parameters")
        prepared = self.prepare_model(model)
        if not set(held) <= {id(p) for p in prepared.parameters()}:
            # FSDP puts sharded parameters in the place of the model's own.
            raise ValueError(
                f"ctx.prepare: with strategy {self.options.strategy!r} the model's parameters "
                "are replaced when it is wrapped: build the optimizer on the parameters of "
                "ctx.prepare_model(model), then call ctx.prepare_optimizer(optimizer)"
            )
        self.prepare_optimizer(optimizer)
        if scheduler is None:
            return prepared, optimizer
        return prepared, optimizer, self.prepare_scheduler(scheduler)

    # -- the steps -----------------------------------------------------------------------

    def batches(
        self, dataset: Dataset[Any], global_batch_size: int, **options: Unpack[StepOptions]
    ) -> Iterator[StepBatch]:
        """One ``StepBatch`` per optimizer step, from where the checkpoint left off to the
        first of ``epochs`` and ``max_steps``. Between steps it reports metrics, saves
        checkpoints every ``checkpoint.every_steps`` and, when the job is to grow, raises
        ``PausedForResize`` right after a checkpoint. Call ``train_step`` on every batch.

        ``num_workers``, ``pin_memory``, ``persistent_workers`` and ``prefetch_factor`` are
        the DataLoader's; the samples, their order and their per-sample random draws
        (``PerSampleRandom``) are the same whatever they are."""
        steps = self._steps(dataset, global_batch_size, **options)
        return (batch for batch in steps if batch is not None)

    def loader(
        self,
        data: Dataset[Any] | DataLoader[Any],
        global_batch_size: int | None = None,
        **options: Unpack[StepOptions],
    ) -> EpochLoader:
        """The steps of ``batches``, iterated as a DataLoader is: each ``for`` over the
        loader is one epoch (after a restore, the rest of the epoch it stopped in), so an
        epoch function keeps its ``for batch in loader:``.

        ``data`` is a dataset, or the script's own DataLoader: its dataset, ``batch_size``
        (the step's global batch, as in a single-process script), ``collate_fn`` and
        worker settings are taken, and the options given here win. The order is the
        context's, shuffled by ``seed``, whatever the DataLoader's sampler. Each sample's
        random draws (augmentations) come from its own seed, (``seed``, epoch, index), as
        with ``PerSampleRandom``: the same at any world size."""
        if isinstance(data, DataLoader):
            options = {**_loader_options(data), **options}
            dataset: Dataset[Any] = data.dataset
            global_batch_size = global_batch_size or data.batch_size
        else:
            dataset = data
        if global_batch_size is None:
            raise ValueError(
                "ctx.loader needs the step's global batch size: pass it, or a DataLoader "
                "with a batch_size"
            )
        if not isinstance(dataset, PerSampleRandom):
            dataset = PerSampleRandom(dataset, options.get("seed", 0))
        return EpochLoader(self._steps(dataset, global_batch_size, **options))

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
        """The steps of ``batches``, each step's bookkeeping done when the loop asks for
        the next; None after the bookkeeping of a step that ended its epoch."""
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
        loading = LoaderOptions(num_workers, pin_memory, persistent_workers, prefetch_factor)
        dataset_size = len(dataset)  # type: ignore[arg-type]
        last_step = self._begin_steps(settings, dataset_size)
        sampler = _StepBatches(
            self.position,
            dataset_size,
            settings,
            self.world_size,
            self.rank,
            last_step - self.step,
        )
        loader = DataLoader(
            EpochItems(dataset),
            batch_sampler=sampler,
            collate_fn=collate_fn,
            generator=_detached_generator(),
            **loading.loader_kwargs(self.device),
        )
        samples = _SampleLog(self.worker, record_samples)
        # After the loop has built (and seeded alike) its model: from here on each rank
        # draws from its own streams, restored or seeded apart.
        rng = RankRng(self.rank, seed, lambda: self.step, self.checkpoints.gather)
        if not self.checkpoints.state.register("rng", rng):
            rng.load_state_dict(None)
        first_step = self.step + 1
        window_start, window_samples = time.perf_counter(), 0
        assert self.model is not None
        self.model.train()
        batch_iter = iter(loader)
        while self.step < last_step:
            inputs, targets = split_batch(next(batch_iter))
            position, indices, global_batch = sampler.plan.pop(0)
            after = advance(position, dataset_size, global_batch_size)
            batch = StepBatch(
                step=self.step + 1,
                epoch=position.epoch,
                inputs=map_tensors(inputs, lambda t: t.to(self.device, non_blocking=True)),
                targets=map_tensors(targets, lambda t: t.to(self.device, non_blocking=True)),
                global_batch=global_batch,
                indices=indices,
                ends_epoch=after.epoch != position.epoch,
            )
            yield batch
            if self._trained != batch.step:
                raise RuntimeError(
                    f"step {batch.step}: every batch must go through ctx.train_step(batch, ...)"
                )
            self.step = batch.step
            samples.write(self.step, position.epoch, indices)
            self.position = after
            window_samples += global_batch
            if batch.ends_epoch and self.rank == 0:
                # The job's log says where it is, for the dashboard's log pane.
                print(
                    f"[elastic-train] epoch {position.epoch} ended at step {self.step} "
                    f"({self.world_size} worker{'s' if self.world_size > 1 else ''})",
                    flush=True,
                )
            draining = False
            if (
                self.step in (first_step, last_step)
                or self.step % report_every_steps == 0
                or self._report_now
            ):
                elapsed = time.perf_counter() - window_start
                rate = window_samples / elapsed if elapsed > 0 else None
                draining = self._report(last_step, rate)
                window_start, window_samples = time.perf_counter(), 0
            # Local SGD's replicas differ between averages: only an averaged model is saved.
            if draining and self.local_sgd is not None and not self.local_sgd.due(self.step):
                draining = False
            if draining or self.step % self.worker.every_steps == 0 or self.step == last_step:
                self._checkpoint(last_step)
            if batch.ends_epoch:
                yield None

    def finish_steps(self) -> None:
        """After the loop returned: a step it trained and then left ``ctx.batches`` on (a
        loop whose epoch function returns at ``batch.ends_epoch``) still gets what follows
        a step there: its count, its report, and the run's final checkpoint. The generator
        is then closed: a step not yet trained is not taken."""
        steps, self._open_steps = self._open_steps, None
        if steps is None:
            return
        try:
            if self._trained is not None and self._trained > self.step:
                next(steps, None)
        finally:
            if isinstance(steps, Generator):
                steps.close()

    def _begin_steps(self, settings: LoopSettings, dataset_size: int) -> int:
        """The learning-rate schedule (restored with the checkpoint) and the micro-batch
        size of a run of steps; returns its last step."""
        if self.model is None or self.optimizer is None:
            raise RuntimeError("call ctx.prepare_model and ctx.prepare_optimizer first")
        last_step = self._final_step = total_steps(settings, dataset_size)
        schedule, warmup = settings.lr_schedule, settings.warmup_steps
        if self.user_scheduler is not None:
            if schedule != "constant" or warmup:
                raise ValueError(
                    "the loop's own LR scheduler (ctx.prepare_scheduler) sets the learning "
                    "rate: leave ctx.batches' lr_schedule 'constant', with no warmup_steps"
                )
        elif self.scheduler is None and hasattr(self.optimizer.step, "_wrapped_by_lr_sched"):
            # torch marks an optimizer's step once any LR scheduler is built on it. Ours sets
            # the rate at every step, so one the context was not given would be overridden
            # without a word.
            raise ValueError(
                "an LR scheduler of the loop's own is on this optimizer, and ctx.batches "
                "would set the learning rate at every step: give it to "
                "ctx.prepare_scheduler(scheduler) (it is then stepped where the loop steps "
                "it, and saved with each checkpoint), or drop it and use ctx.batches' "
                "lr_schedule='constant' or 'cosine' and warmup_steps=N"
            )
        else:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: lr_factor(s, last_step, schedule, warmup)
            )
            if self.checkpoints.state.register("scheduler", self.scheduler):
                # Making the scheduler set the lr of step 0; the restored step's lr is the one.
                for group, lr in zip(
                    self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True
                ):
                    group["lr"] = lr
        # The micro-batch is a worker's share at full size: fewer workers accumulate more
        # of them, so memory per step stays put and one optimizer step still sees the
        # global batch.
        self._micro = math.ceil(settings.global_batch_size / self.worker.max_workers)
        return last_step

    def train_step(
        self,
        batch: StepBatch,
        loss_per_sample: LossPerSample | None = None,
        *,
        forward: Forward | None = None,
        before_step: BeforeStep | None = None,
    ) -> float | None:
        """Forward and backward over the batch in micro-batches, the gradients of the whole
        global batch combined across workers, then one optimizer and LR-schedule step;
        returns the step's mean loss over the global batch (every worker gets the same).

        The forward pass is the context's, ``loss_per_sample(model(inputs), targets)``, or
        the loop's own, ``forward(micro)`` for each :class:`MicroBatch`. Either returns one
        loss per sample (e.g. ``reduction="none"``): the step minimises their exact mean
        over the global batch whatever the world size. ``before_step()`` runs between the
        last backward pass and the optimizer step, on the final gradients.

        In place a step a lost peer cut short is discarded: it returns None and the same
        samples come again."""
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None
        run = self._forward_pass(loss_per_sample, forward)
        inputs = self._cast(batch.inputs)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.float64)
        passes = passes_per_step(batch.global_batch, self.world_size, self._micro)
        slices = micro_batch_plan(batch.real, self._micro, passes)
        # The step's loss over the global batch, for the loop and the report alike: on Gloo
        # it is summed across workers while the last backward pass runs (it is known once
        # that pass's forward is done), rather than in a round trip of its own after it.
        totals_sum: PendingAllReduce | None = None
        for n, (a, b) in enumerate(slices):
            padding = b == a
            if padding:
                a, b = 0, 1  # one row through the model, weighted zero
            micro = micro_batch(inputs, batch.targets, a, b, padding)
            # Gradients are combined on the last micro-batch only; the others accumulate.
            with gradient_sync(model, sync=n == len(slices) - 1):
                with self.precision.autocast():
                    losses, right = run(micro)
                if padding:
                    loss = losses.sum() * 0.0
                else:
                    # DDP and FSDP average over ranks; world/global makes the sum the exact
                    # mean over the global batch whatever the world size and its split.
                    loss = losses.sum() * (self.world_size / batch.global_batch)
                    if right is not None:
                        correct += right
                    loss_sum += losses.detach().sum()
                if n == len(slices) - 1 and self.world_size > 1 and self.device.type == "cpu":
                    totals = torch.stack([loss_sum, correct])
                    totals_sum = start_all_reduce(totals, self.worker.abandoned)
                self.precision.backward(loss)
        if totals_sum is None:
            totals = torch.stack([loss_sum, correct])
            if self.world_size > 1:
                totals_sum = start_all_reduce(totals, self.worker.abandoned)
        if totals_sum is not None:
            totals_sum.wait()
        self.checkpoints.before_update()  # the hook may write what the snapshot copies
        self._before_step(before_step)
        self.precision.step(optimizer)
        self.worker.completed_step = batch.step
        if self.scheduler is not None:  # the loop's own, if any, it steps itself
            self.scheduler.step()
        # Local SGD averages every H steps and at the end, so the final model is the
        # average; submission makes checkpoint.every_steps a multiple of H, so every
        # checkpoint holds the averaged model too.
        if self.local_sgd is not None and (
            self.local_sgd.due(batch.step) or batch.step == self._final_step
        ):
            self.local_sgd.average(model, batch.step)
        self._totals = totals
        self._counts_accuracy = forward is None
        self._step_global_batch = batch.global_batch
        self._trained = batch.step
        return float(totals[0]) / batch.global_batch

    def _forward_pass(
        self, loss_per_sample: LossPerSample | None, forward: Forward | None
    ) -> Callable[[MicroBatch], tuple[torch.Tensor, torch.Tensor | None]]:
        """A micro-batch's per-sample losses and, for the context's own forward pass over
        class scores, its count of right answers (the report's accuracy)."""
        if (loss_per_sample is None) == (forward is None):
            raise TypeError("give train_step either loss_per_sample or forward=, not both")
        if forward is not None:
            user_forward = forward

            def own(micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
                return per_sample_losses(user_forward(micro), micro), None

            return own
        assert self.model is not None and loss_per_sample is not None
        model, loss_fn = self.model, loss_per_sample

        def context_s(micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            if micro.targets is None:
                raise ValueError(
                    "this dataset's samples are not (inputs, targets) pairs: pass "
                    "train_step a forward=fn(micro) that computes the loss from micro.inputs"
                )
            outputs = model(micro.inputs)
            losses = loss_fn(outputs, micro.targets)
            right = None
            if (
                isinstance(outputs, torch.Tensor)
                and outputs.dim() == 2
                and isinstance(micro.targets, torch.Tensor)
                and not micro.targets.is_floating_point()
            ):
                right = (outputs.argmax(dim=1) == micro.targets).sum()
            return losses, right

        return context_s

    def _before_step(self, before_step: BeforeStep | None) -> None:
        if before_step is None:
            return
        if self.precision.scaler is not None:
            assert self.optimizer is not None
            # fp16: the hook sees the true gradients (a clipping norm means what it says);
            # the scaler's step then knows they are unscaled already.
            self.precision.scaler.unscale_(self.optimizer)
        before_step()

    def _cast(self, inputs: Any) -> Any:
        """Floating inputs in the model's dtype (float64 runs)."""
        dtype = self.dtype
        if dtype is None or dtype == torch.float32:
            return inputs
        return map_tensors(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def report(self, **metrics: Any) -> None:
        """Extra metrics for the next report (this step's when it reports, as after
        ``evaluate``). Safe on any subset of ranks: it only notes the values, and reports
        happen on a schedule every rank shares. Rank 0's values are the ones sent."""
        self._extra_metrics.update(metrics)

    def evaluate(
        self,
        dataset: Dataset[Any],
        loss_per_sample: LossPerSample | None = None,
        batch_size: int = 256,
    ) -> dict[str, float]:
        """The model on a held-out dataset, split across the workers; every rank must call
        it. ``eval_accuracy`` when the outputs are class scores and the targets class ids,
        ``eval_loss`` (the mean of ``loss_per_sample``) when it is given. The result also
        goes into the current step's report."""
        model = self.model
        assert model is not None
        size = len(dataset)  # type: ignore[arg-type]
        start, end = share(size, self.world_size, self.rank)
        # FSDP gathers parameters in every forward: all ranks run the same number of them.
        rounds = math.ceil(math.ceil(size / self.world_size) / batch_size)
        # correct, samples with class scores, loss sum, samples
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        model.eval()
        with torch.no_grad():
            for r in range(rounds):
                lo, hi = start + r * batch_size, min(start + (r + 1) * batch_size, end)
                if hi <= lo and not is_sharded(model):
                    break
                idx = list(range(lo, hi)) if hi > lo else [0]
                rows = DataLoader(
                    Subset(dataset, idx), batch_size=len(idx), generator=_detached_generator()
                )
                inputs, targets = next(iter(rows))
                inputs = self._cast(map_tensors(inputs, lambda t: t.to(self.device)))
                targets = targets.to(self.device)
                with self.precision.autocast():
                    outputs = model(inputs)
                if hi <= lo:
                    continue  # a forward to keep FSDP's collectives in step, nothing to count
                if outputs.dim() == 2 and outputs.shape[1] > 1 and not targets.is_floating_point():
                    totals[0] += (outputs.argmax(dim=1) == targets).sum()
                    totals[1] += len(idx)
                if loss_per_sample is not None:
                    totals[2] += loss_per_sample(outputs.float(), targets).double().sum()
                totals[3] += len(idx)
        model.train()
        if self.world_size > 1:
            all_reduce(totals, self.worker.abandoned)
        result = {}
        if totals[1] > 0:
            result["eval_accuracy"] = float(totals[0] / totals[1])
        if loss_per_sample is not None and totals[3] > 0:
            result["eval_loss"] = float(totals[2] / totals[3])
        self._extra_metrics.update(result)
        self._report_now = True
        return result

    # -- between steps -------------------------------------------------------------------

    def _report(self, last_step: int, samples_per_s: float | None) -> bool:
        """Report the step's metrics; returns whether a node of the attempt is draining,
        which rank 0 knows and a sum at each report tells every rank."""
        drain = 1.0 if self.rank == 0 and self.worker.drain_noticed() else 0.0
        flag = torch.tensor([drain], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            all_reduce(flag, self.worker.abandoned)
        if self.rank == 0:
            report = self._metrics(self._totals, last_step, samples_per_s, self.world_size)
            self.worker.emit(EventKind.METRICS, report)
        self._extra_metrics = {}
        self._report_now = False
        return bool(flag[0] > 0)

    def _metrics(
        self,
        totals: torch.Tensor,
        last_step: int,
        samples_per_s: float | None,
        world_size: int,
        **more: Any,
    ) -> dict[str, Any]:
        """The report of the step just completed: ``totals`` holds its summed loss and count
        of correct answers over the global batch; ``more``, what a mode adds; then what the
        loop added with ``ctx.report``."""
        assert self.optimizer is not None
        global_batch = self._step_global_batch
        return {
            "step": self.step,
            "epoch": self.position.epoch if self.position.consumed else self.position.epoch - 1,
            "loss": float(totals[0]) / global_batch,
            # Counted only by the context's own forward pass, which sees the outputs.
            "accuracy": float(totals[1]) / global_batch if self._counts_accuracy else None,
            "samples_per_s": samples_per_s,
            "learning_rate": (
                self.scheduler.get_last_lr()[0]
                if self.scheduler is not None
                else float(self.optimizer.param_groups[0]["lr"])
            ),
            "world_size": world_size,
            "total_steps": last_step,
            "completed_step": self.worker.completed_step,
            **more,
            **self._extra_metrics,
        }

    def _checkpoint(self, last_step: int) -> None:
        # Training waits only for the copy to CPU; the write goes on in the background.
        self.checkpoints.save(self.step)
        pause = False
        if self.rank == 0 and self.step < last_step:
            pause = self.worker.should_pause(self.step)
        if self.world_size > 1 and self.step < last_step:
            flag = torch.tensor([1.0 if pause else 0.0], device=self.device)
            all_reduce(flag, self.worker.abandoned)
            pause = bool(flag.item() > 0)
        if pause or self.step == last_step:
            # The next attempt starts from this checkpoint: it must be published first.
            self.checkpoints.wait()
        if pause:
            raise PausedForResize(self.step)


def _loader_options(loader: DataLoader[Any]) -> StepOptions:
    """What a script's DataLoader says of how its samples are loaded."""
    options = StepOptions(
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )
    if loader.num_workers > 0:
        options["persistent_workers"] = loader.persistent_workers
        options["prefetch_factor"] = loader.prefetch_factor
    return options


def _detached_generator() -> torch.Generator:
    """A generator of the loader's own. Each ``iter(DataLoader)`` draws a seed for its
    workers from its generator, by default the process's: a resumed run, which builds its
    loader after restoring the streams, would take one draw more than the uninterrupted run
    had, and every later dropout mask and random augmentation would differ."""
    return torch.Generator()


def run_with_context(
    train_loop: Callable[..., Any],
    config: dict[str, Any],
    worker: WorkerContext | None = None,
) -> None:
    """Run a loop (``train_loop(config, ctx)``, or a ``main()`` of no arguments: see
    ``elastic.train.current``); a pause for a resize ends it normally."""
    ctx = TrainContext(config, worker or WorkerContext.from_config(config))
    try:
        call_train_loop(train_loop, config, ctx)
        ctx.finish_steps()
        # A loop that left ``ctx.batches`` early: its last checkpoint is still published.
        ctx.checkpoints.wait()
    except PausedForResize:
        return
    except AttemptAbandoned:
        raise  # the supervisor knows already: the failure was another worker's
    except Exception:
        if ctx.world_size > 1:
            # This worker's first sign that the attempt failed (most often a collective
            # that lost a peer), stamped now: recovery is timed from the earliest one.
            ctx.worker.emit(
                EventKind.FAILURE_SIGNAL,
                {
                    "rank": ctx.rank,
                    "time": time.time(),
                    "completed_step": ctx.worker.completed_step,
                },
            )
        raise
    finally:
        ctx.worker.close()  # the TensorBoard points so far reach the disk, whatever happened


__all__ = [
    "EpochLoader",
    "MicroBatch",
    "PausedForResize",
    "PerSampleRandom",
    "StepBatch",
    "TrainContext",
    "run_with_context",
    "unwrap",
]
