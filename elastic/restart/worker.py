"""Restart mode's worker: an actor that outlives the job's attempts. It imports torch, the
training loop and the job's module once, when it is placed, so that the next attempt on it starts
at once; each attempt it joins a new process group, runs the job's ``train_loop`` from the
attempt's checkpoint, and leaves the group when the loop ends, whatever happened.

When its node's raylet dies it dies too (``elastic/train/orphan.py``): the survivors'
collectives fail at once, and the attempt ends on that first signal."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import ray

from elastic import warm_processes
from elastic.arrivals import Outbox
from elastic.events import EventKind
from elastic.train.entrypoint import EntrypointError, last_line, resolve
from elastic.train.group_sockets import GroupSockets, Joining
from elastic.train.orphan import die_with_parent
from elastic.train.worker_logs import FLUSH_S, LOG_FLUSH_S, forward_output

log = logging.getLogger(__name__)

# How long a worker's run waits, after its loop ended, for a checkpoint write in flight
# (the next attempt must not start beside an old writer); past it the worker is replaced.
WRITER_WAIT_S = 10.0


def _device() -> Any:
    """This worker's device: its GPU when Ray gave it one (Ray's ``CUDA_VISIBLE_DEVICES``
    shows the actor its own GPUs only), else the CPU."""
    import torch

    if ray.get_gpu_ids() and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _writers_done(timeout_s: float) -> bool:
    """Wait for this process's checkpoint writer threads (an attempt that failed may leave
    one in flight); False when one is still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name == "checkpoint-writer" and thread.is_alive():
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
    return True


# Two threads: ``run`` trains; ``open_store`` and ``ping`` answer meanwhile.
@ray.remote(max_restarts=0, max_concurrency=2)  # type: ignore[call-overload]
class WarmWorker:
    def __init__(self) -> None:
        from elastic.addresses import bind_gloo_to

        self.store: Any = None
        self.training_thread: int | None = None  # while a run goes on
        self.attempt: int | None = None  # the latest run's
        self.abandoned = threading.Event()  # the latest run's: see ``abandon``
        self.group: GroupSockets | None = None  # the latest run's, once it joined its group
        self.joining: Joining | None = None  # the latest run's, while it joins its group
        # Its node's raylet gone, it ends at once (not at Ray's check a second later): the
        # survivors' collectives fail now, and the attempt ends on that.
        die_with_parent()
        bind_gloo_to(ray.util.get_node_ip_address())
        warm_processes.adopt(warm_processes.Kind.TRAINING)

    def warm(self, train_loop: str) -> tuple[str, int]:
        """Import what every attempt needs, once; returns (node id, pid)."""
        import torch

        # The first optimizer a process builds imports it: over a second on the dev box,
        # which would otherwise fall in the first attempt on this worker (a grow's pause).
        import torch._dynamo  # noqa: F401

        import elastic.train.context  # noqa: F401

        try:  # the job's own module; an error here is the loop's to report, at its run
            resolve(train_loop)
        except Exception as e:
            log.info("warming %s: %r", train_loop, e)
        # What was imported lives as long as the process: out of the collector's sight, the
        # collections at each attempt's end take under a millisecond instead of 0.15 s each
        # (they are on the path of every restart and every pause to grow).
        gc.freeze()
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def ping(self) -> int:
        return os.getpid()

    def joined(self, attempt: int) -> bool:
        """Whether this worker's run of ``attempt`` has joined its group: until every worker
        has, the supervisor pings them (a peer that dies then leaves the others waiting in
        the join, with no error to tell)."""
        return self.attempt == attempt and self.group is not None

    def abandon(self, attempt: int) -> None:
        """The supervisor gave up on ``attempt`` (a worker of it failed or died): the
        collectives still waiting give up now, whatever they wait on. A peer whose node
        froze or vanished sends nothing, not even a reset, so a wait on it would otherwise
        last until the collective timeout. Word of an earlier attempt is ignored."""
        if self.attempt == attempt:
            self.abandoned.set()  # before the groups are read: see ``run`` and ``forming``
            for group in (self.group, self.joining):
                if group is not None:
                    group.shut()

    @contextlib.contextmanager
    def forming(self, rank: int, world_size: int, host: str, port: int) -> Iterator[None]:
        """A further process group of the run forms (every rank at once, through the
        attempt's store): the supervisor's word reaches it as it reaches the join."""
        from elastic.train.process_group import AttemptAbandoned

        self.joining = Joining(rank, world_size, host, port)
        try:
            if self.abandoned.is_set():  # given up before the formation could be seen
                raise AttemptAbandoned("the attempt failed elsewhere")
            yield
        finally:
            self.joining = None

    def where(self, rank: int, after_s: float) -> str:
        """Where this worker's training thread is, as a stack, also printed into the job's
        log: asked of a run that did not end ``after_s`` after its attempt failed, before it
        is killed. It returns once the log forwarder has sent the lines on."""
        thread = self.training_thread
        frame = None if thread is None else sys._current_frames().get(thread)
        if frame is None:
            return ""
        stack = "".join(traceback.format_stack(frame))
        print(
            f"[elastic-train] rank {rank} did not end within {after_s:g} s of the attempt's "
            f"failure; its training thread is at:\n{stack}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(FLUSH_S + 0.2)
        return stack

    def open_store(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0 of an attempt: a fresh rendezvous store on this node's Ray address."""
        from elastic.train.process_group import bound_store

        self._close_store()
        host = ray.util.get_node_ip_address()
        self.store = bound_store(host, world_size, timeout_s)
        return host, int(self.store.port)

    def _close_store(self) -> None:
        """The store closes its socket when the last reference to it goes (see
        ``bound_store``); a process group that outlives its attempt keeps it open."""
        self.store = None

    def run(
        self,
        config: dict[str, Any],
        rank: int,
        world_size: int,
        host: str,
        port: int,
        backend: str,
        timeout_s: float,
    ) -> dict[str, Any]:
        """One attempt's training loop on this worker. Never raises for the loop's sake:
        returns ``error`` (None when the loop ended well, or paused), ``failed_at`` and
        ``clean`` (whether this process can serve the next attempt)."""
        import torch
        import torch.distributed as dist

        from elastic.train.context import run_with_context
        from elastic.train.process_group import AttemptAbandoned, join_process_group
        from elastic.train.worker import WorkerContext

        meta = config["_elastic"]
        supervisor = ray.get_actor(meta["supervisor"], namespace=meta["namespace"])
        outbox = Outbox(supervisor)
        last_sent: list[Any] = []

        def send(lines: list[list[Any]]) -> None:
            last_sent[:] = [
                outbox.record(
                    EventKind.LOG, {"attempt": meta["attempt"], "rank": rank, "lines": lines}
                )
            ]

        result: dict[str, Any] = {"error": None, "failed_at": None, "clean": True}
        self.training_thread = threading.get_ident()
        abandoned = self.abandoned = threading.Event()
        self.attempt, self.group = meta["attempt"], None
        self.joining = Joining(rank, world_size, host, port)
        try:
            with forward_output(send):
                try:
                    master = self.store if rank == 0 else None
                    group = join_process_group(
                        backend,
                        rank,
                        world_size,
                        host,
                        port,
                        timeout_s,
                        master_store=master,
                        abandoned=abandoned,
                    )
                    self.group, self.joining = group, None
                    if abandoned.is_set():  # given up while it joined: see ``abandon``
                        group.shut()
                    # A command job's GPUs are its command's: the worker makes no CUDA context
                    # there (it would hold the GPU's memory beside the command).
                    device = torch.device("cpu") if "command" in config else _device()
                    worker = WorkerContext.from_config(config, rank, world_size, device)
                    worker.abandoned = abandoned
                    worker.forming = functools.partial(self.forming, rank, world_size, host, port)
                    run_with_context(resolve(meta["train_loop"]), config, worker)
                except AttemptAbandoned:
                    pass  # the attempt's failure is another worker's to report
                except Exception as e:
                    if abandoned.is_set() and self.group is None:
                        # Its join was given up (its sockets shut): the attempt failed
                        # elsewhere, and this worker is as clean as one that never joined.
                        log.info("rank %s left its group's join: %r", rank, e)
                    else:
                        result["failed_at"] = time.time()  # before its peers fail because of it
                        # Peers waiting on this worker in a collective fail now, rather than at
                        # the collective timeout: its group's sockets stay open otherwise
                        # (elastic/train/group_sockets.py).
                        if self.group is not None:
                            self.group.shut()
                        text = last_line(str(e))
                        result["error"] = (
                            f"{type(e).__name__}: {text}" if text else type(e).__name__
                        )
                        result["code_error"] = isinstance(e, EntrypointError)
                        traceback.print_exc()  # into the job's log
                finally:
                    self.joining = None
                    with contextlib.suppress(Exception):
                        if dist.is_initialized():
                            dist.destroy_process_group()
                    gc.collect()
                    self._close_store()
                    result["clean"] = _writers_done(WRITER_WAIT_S)
        finally:
            self.training_thread = None
            with contextlib.suppress(Exception):
                ray.get(last_sent, timeout=LOG_FLUSH_S)
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        return result
