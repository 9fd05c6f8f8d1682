"""Saving and restoring a worker's checkpoints, off the training's critical path.

At a checkpoint step every rank copies its state to CPU memory; that copy is all training
waits for. A background thread then writes, fsyncs, hashes, publishes (the manifest last,
then the rename) and prunes, while training goes on; at most one write is in flight, so a
write slower than the checkpoint interval makes the next checkpoint wait rather than pile
up copies in memory. ``checkpoint_saved`` is sent when the write is published, not before.

Replicated parts go into ``state.pt``, written by rank 0 alone. Sharded parts (FSDP's model
and optimizer) go into ``sharded/``, each rank writing its own pieces with
``torch.distributed.checkpoint`` over a Gloo group of their own (the training's group is
busy with training meanwhile); nobody gathers the whole model, and a restore at any world
size reads only the pieces that rank needs.
"""

from __future__ import annotations

import datetime
import io
import pickle
import shutil
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.parts import CheckpointState
from elastic.events import EventKind
from elastic.train.process_group import all_reduce
from elastic.train.worker import WorkerContext

STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"


def cpu_copy(
    obj: Any,
    copy_if: Callable[[torch.Tensor], bool] | None = None,
    staging: StagingBuffers | None = None,
    path: tuple[Any, ...] = (),
) -> Any:
    """A deep copy with every tensor in CPU memory that training can no longer change
    (a CPU tensor is cloned: training would otherwise overwrite it mid-write). Only the
    tensors ``copy_if`` picks (all, without it) are copied; the others stay as they are.
    With ``staging``, tensors are copied into its buffers, found by their place in ``obj``."""
    if isinstance(obj, torch.Tensor):
        if copy_if is not None and not copy_if(obj):
            return obj
        return _tensor_copy(obj) if staging is None else staging.copy(obj, path)
    if isinstance(obj, dict):
        return {k: cpu_copy(v, copy_if, staging, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v, copy_if, staging, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(cpu_copy(v, copy_if, staging, (*path, i)) for i, v in enumerate(obj))
    return obj  # numbers, strings, None: immutable


class StagingBuffers:
    """CPU buffers that every checkpoint of a worker copies its state into, kept from one
    checkpoint to the next: a copy into memory already touched costs under a quarter of the
    CPU of one into new memory, which the kernel must map and zero first (588 MiB: 0.08
    against 0.35 CPU-s, ``bench/checkpoint_stall.py --phases`` in docs/benchmarks.md).
    They hold as much memory as one checkpoint, for the worker's life; only one write is in
    flight at a time, so a buffer is never refilled while it is being written."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        if not _reusable(t):
            return _tensor_copy(t)
        buffer = self.buffers.get(path)
        if (
            buffer is None
            or buffer.dtype != t.dtype
            or buffer.shape != t.shape
            or buffer.stride() != t.stride()
        ):
            buffer = self.buffers[path] = torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device="cpu"
            )
        buffer.copy_(t.detach())
        return buffer


def _reusable(t: torch.Tensor) -> bool:
    """A plain dense tensor (which a buffer of its strides holds whole): the rest (DTensors,
    sparse, quantised, views with gaps or overlaps) gets a copy of its own each time."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False
    return t.layout == torch.strided and not t.is_quantized and t.is_contiguous()


def _storage(t: torch.Tensor) -> int:
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t.to_local()
    return int(t.untyped_storage().data_ptr())


def _tensor_copy(t: torch.Tensor) -> torch.Tensor:
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            local = t.to_local().detach().to("cpu", copy=True)
            return DTensor.from_local(
                local,
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
    return t.detach().to("cpu", copy=True)


# What ``torch.distributed.checkpoint``'s metadata pickles name: its own records, torch's
# sizes, dtypes and layouts, paths. Anything else in that file is refused.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module in _METADATA_MODULES
            or (module, name) in _METADATA_NAMES
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata may not name {module}.{name}")
        return super().find_class(module, name)


def sharded_reader(path: str | Path) -> Any:
    """A reader of a sharded checkpoint that never runs the standard unpickler: DCP's own
    reader unpickles its metadata file with it (and would run what the file names)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with (Path(self.path) / ".metadata").open("rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def weights_only_planner() -> Any:
    """DCP's load planner with its non-tensor values (an optimizer's param groups) read by
    ``torch.load(weights_only=True)``; DCP's own reads them with ``weights_only=False``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            super().load_bytes(read_item, _as_bytes(loaded))

    return Planner()


def _as_bytes(obj: Any) -> io.BytesIO:
    # The parent's load_bytes reads the value itself: hand it the already-vetted object
    # re-serialised, which holds nothing ``weights_only`` would have refused.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def _load_sharded_state(wanted: dict[str, Any], path: Path, *, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(
        wanted,
        storage_reader=sharded_reader(path),
        planner=weights_only_planner(),
        no_dist=no_dist,
    )


def load_model(checkpoint: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """Put a checkpoint's model into a plain ``model`` on this process (no process group,
    either layout): to evaluate or export what a job trained."""
    path = Path(checkpoint)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if "model" in state:
        model.load_state_dict(state["model"])
        return model
    wanted = {"model": model.state_dict()}
    _load_sharded_state(wanted, path / SHARDED_DIR, no_dist=True)
    model.load_state_dict(wanted["model"])
    return model


def save_unchecked(obj: Any, path: Path) -> None:
    """``torch.save`` without its zip records' CRC-32: the manifest's SHA-256 of the whole
    file is what a restore checks, and the CRC was a second pass over every byte (588 MiB:
    0.32 against 0.18 CPU-s, docs/benchmarks.md). ``torch.load`` reads the file
    as ever. The setting is process-wide while the save runs: a user's own ``torch.save``
    meanwhile also skips the CRC, which changes no byte of its tensors."""
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        torch.save(obj, path)


class BackgroundWriter:
    """One write at a time on a thread of its own; its failure surfaces at the next
    ``submit`` or ``wait`` (on the training thread, which then ends the attempt)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # handed to the training thread
                self._error = e

        # A daemon: a worker that is being torn down does not wait for a write; what it
        # leaves half-done is a staging directory, cleaned at the next start.
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class CheckpointManager:
    def __init__(
        self,
        worker: WorkerContext,
        updated_in_step: Callable[[], list[torch.Tensor]] | None = None,
    ) -> None:
        """``updated_in_step``: the tensors that change only in the optimizer step
        (parameters, optimizer state); their copy overlaps the next forward and backward."""
        self.worker = worker
        self.updated_in_step = updated_in_step
        self._copied = threading.Event()
        self._copied.set()
        self.dir = worker.checkpoints
        self.writer = BackgroundWriter()
        self.staging = StagingBuffers()
        self.group: Any = None
        if dist.is_available() and dist.is_initialized():
            # Collective: every rank builds it at the same point (the context's start).
            # Its collectives wait for the slowest rank's previous write (rank 0 also
            # hashes and prunes), so its timeout is storage's, not the training's. Its
            # formation waits for every rank under that hour too: the ranks first meet in
            # an all-reduce, so that a peer lost as the attempt starts fails this run at
            # once (Gloo's reset), and the formation itself is one the supervisor's word
            # can end (``worker.forming``).
            if dist.get_backend() == "gloo":
                all_reduce(torch.zeros(1), worker.abandoned)
            with worker.forming():
                self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=1))
        # A local directory with the parts (downloaded when checkpoints are in a bucket).
        self.resume_path: Path | None = None
        restored = self._load(worker.resume_path) if worker.resume_path else None
        self.state = CheckpointState(restored, self._load_sharded if restored is not None else None)

    @property
    def restored(self) -> dict[str, Any] | None:
        return self.state.restored  # type: ignore[return-value]

    # -- restore -------------------------------------------------------------------------

    def _load(self, location: str) -> dict[str, Any]:
        # The supervisor verified it when it chose it; storage may have changed since.
        self.resume_path = self.dir.local_copy(location)
        if self.dir.remote:
            # The download is this process's alone; it goes when the process does.
            weakref.finalize(self, shutil.rmtree, str(self.resume_path), True)
        state = torch.load(self.resume_path / STATE_FILE, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{self.resume_path}: {STATE_FILE} holds no state dict")
        return state

    def _load_sharded(self, name: str, template: Any) -> Any:
        assert self.resume_path is not None
        wanted = {name: template}
        # Each rank reads the pieces its template's shards cover: a reshard when the
        # world size changed.
        _load_sharded_state(wanted, self.resume_path / SHARDED_DIR)
        return wanted[name]

    # -- save ----------------------------------------------------------------------------

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, on rank 0 (others get an empty list)."""
        if self.group is None or self.worker.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.worker.world_size if self.worker.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []

    def save(self, step: int) -> None:
        """Collective: snapshot every part to CPU, then write in the background.

        What the next optimizer step changes (parameters, optimizer state: nearly all of
        it) is copied by the writer thread while the next forward and backward run, and
        :meth:`before_update` holds that optimizer step until the copy is done, as
        CheckFreq does; everything else (buffers, counters, generators) is copied now."""
        self.writer.wait()  # one write at a time (and the copy buffers it holds)
        replicated: dict[str, Any] | None = self.state.replicated_state()  # RNG: gathers
        if self.state.sharded and self.dir.remote and self.worker.world_size > 1:
            # Each rank's pieces are staged on its own node's disk and rank 0 uploads
            # only what it sees: refuse rather than publish a checkpoint missing pieces.
            raise NotImplementedError(
                "sharded (FSDP) checkpoints of several workers cannot go to an object "
                "store yet; use a shared filesystem for ETRAIN_CHECKPOINT_DIR"
            )
        sharded = self.state.sharded_state() if self.state.sharded else {}
        if self.worker.rank != 0:
            replicated = None
            if not sharded:
                return  # a replica: rank 0 writes the replicated state
        later = frozenset(_storage(t) for t in (self.updated_in_step or list)())
        now = cpu_copy((replicated, sharded), lambda t: _storage(t) not in later, self.staging)
        self._copied.clear()

        def copy_then_write() -> None:
            try:
                snapshot, shards = cpu_copy(now, lambda t: _storage(t) in later, self.staging)
            finally:
                self._copied.set()
            self._write(step, snapshot, shards)

        self.writer.submit(copy_then_write)

    def before_update(self) -> None:
        """Called before each optimizer step: until the checkpoint's copy of the state
        that step changes is taken."""
        self._copied.wait()

    def wait(self) -> None:
        """Until the write in flight is published (or raise its failure)."""
        self.writer.wait()

    def _write(self, step: int, replicated: dict[str, Any] | None, sharded: dict[str, Any]) -> None:
        # The same staging name on every rank: the sharded pieces meet in one directory.
        with self.dir.staging(step, f"attempt-{self.worker.attempt}") as staged:
            if sharded:
                import torch.distributed.checkpoint as dcp

                # Returns on rank 0 once every rank's pieces and the metadata are written.
                dcp.save(sharded, checkpoint_id=str(staged / SHARDED_DIR), process_group=self.group)
            if replicated is None:
                return  # rank 0 publishes
            save_unchecked(replicated, staged / STATE_FILE)
            info = self.dir.publish(step, staged)
        self.worker.emit(
            EventKind.CHECKPOINT_SAVED,
            {
                "step": step,
                "path": info.path,
                "size_bytes": info.size_bytes,
                "created_at": info.created_at,
                "completed_step": self.worker.completed_step,
            },
        )
        # A line for the job's log (the dashboard's log pane), besides the event.
        print(
            f"[elastic-train] checkpoint of step {step} saved ({_size(info.size_bytes)})",
            flush=True,
        )
        pruned = self.dir.prune(self.worker.keep, protect=step)
        for bad, why, _ in pruned.set_aside:
            self.worker.emit(
                EventKind.CHECKPOINT_CORRUPT, {"step": bad.step, "path": bad.path, "reason": why}
            )
        # A checkpoint moved aside is gone from the job's list as a deleted one is.
        for removed in [*(bad for bad, _, _ in pruned.set_aside), *pruned.removed]:
            self.worker.emit(
                EventKind.CHECKPOINT_REMOVED, {"step": removed.step, "path": removed.path}
            )


def _size(n: int) -> str:
    """In binary units, as `etrain checkpoints` and the dashboard show checkpoint sizes
    (elastic_train.render.size; the workers do not import the client)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
