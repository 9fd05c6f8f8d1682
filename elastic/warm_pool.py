"""Restart mode on warm workers: a pool of worker actors that outlive the job's attempts.

An attempt of a ``restart``-mode job is a process group formed by the pool's actors, one
per worker slot, each holding the job's ``resources_per_worker``: rank 0 opens a rendezvous
store bound to its node's Ray address, every rank joins the group through it and runs the
job's ``train_loop`` from the attempt's checkpoint, and leaves the group when the loop ends,
whatever happened. An actor imports torch, the training loop and the job's module once, when
it is placed, so the next attempt on it starts at once.

When a node dies, its actors die with their raylet (``elastic/in_place/orphan.py``): the
survivors' collectives fail at once, each survivor's loop raises and leaves the group, and
the attempt ends on that first signal, without waiting for Ray's membership (seconds). The
survivors stay in the pool, so the next attempt, at the smaller size from the newest
checkpoint, starts on processes that are already up. An actor that does not end within a
bound, or whose end was not clean (a checkpoint writer still running), is killed and its
slot gets a new actor at the next attempt.

Why not Ray Train's ``TorchTrainer``: a Ray Train run starts a new worker group (new
processes, each importing torch) for every ``fit()``, behind a controller actor of its own
and helper actors; it cannot keep worker processes across runs, and the supervisor starts a
run per attempt (it re-sizes the job between attempts). On the 2-core development machine
that chain cost about 20 s of every restart (``bench/restart_profile.py``).

The supervisor's side imports neither torch nor Ray Train: both are imported inside the
actor's methods, which run in the workers' processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
import traceback
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import ray

from elastic.arrivals import Outbox
from elastic.attempt import AttemptOutcome
from elastic.attempt_runner import AttemptSpec, RunningAttempt, last_line, resolve
from elastic.in_place.orphan import die_with_parent
from elastic.worker_logs import forward_output

log = logging.getLogger(__name__)

# After an attempt's first failure (a worker's error, or a worker that died), how long the
# other workers' runs may take to end: a survivor's loop raises at its next collective, and
# the call to a worker on a dead node fails once Ray gives up on its connection.
SETTLE_S = 5.0
# At an attempt's first failure every worker still running is asked whether its process
# answers: one that does not within PING_S is counted dead (its node lost) and killed. One
# whose run did not end within SETTLE_S is asked again, and killed whatever it answers.
PING_S = 1.5
# How long a worker's run waits, after its loop ended, for a checkpoint write in flight
# (the next attempt must not start beside an old writer); past it the worker is replaced.
WRITER_WAIT_S = 10.0
# How long a worker waits for its last log lines to reach the supervisor.
LOG_FLUSH_S = 10.0
# After the supervisor stopped an attempt (Ray's membership lost one of its nodes, which
# can come before the survivors' own collective errors on a busy machine), how long the
# workers still running may take to end by themselves and stay warm before they are killed.
STOP_SETTLE_S = 3.0


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
        # Its node's raylet gone, it ends at once (not at Ray's check a second later): the
        # survivors' collectives fail now, and the attempt ends on that.
        die_with_parent()
        bind_gloo_to(ray.util.get_node_ip_address())

    def warm(self, train_loop: str) -> tuple[str, int]:
        """Import what every attempt needs, once; returns (node id, pid)."""
        import torch  # noqa: F401

        import elastic.loop  # noqa: F401

        try:  # the job's own module; an error here is the loop's to report, at its run
            resolve(train_loop)
        except Exception as e:
            log.info("warming %s: %r", train_loop, e)
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def ping(self) -> int:
        return os.getpid()

    def open_store(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0 of an attempt: a fresh rendezvous store on this node's Ray address."""
        from elastic.process_group import bound_store

        self._close_store()
        host = ray.util.get_node_ip_address()
        self.store = bound_store(host, world_size, timeout_s)
        return host, int(self.store[0].port)

    def _close_store(self) -> None:
        if self.store is not None:
            _, listener = self.store
            self.store = None
            with contextlib.suppress(OSError):
                listener.close()

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

        from elastic.loop import run_with_context
        from elastic.process_group import join_process_group
        from elastic.worker import WorkerContext

        meta = config["_elastic"]
        supervisor = ray.get_actor(meta["supervisor"], namespace=meta["namespace"])
        outbox = Outbox(supervisor)
        last_sent: list[Any] = []

        def send(lines: list[list[Any]]) -> None:
            last_sent[:] = [
                outbox.record("log", {"attempt": meta["attempt"], "rank": rank, "lines": lines})
            ]

        result: dict[str, Any] = {"error": None, "failed_at": None, "clean": True}
        try:
            with forward_output(send):
                try:
                    master = self.store[0] if rank == 0 and self.store else None
                    join_process_group(
                        backend, rank, world_size, host, port, timeout_s, master_store=master
                    )
                    worker = WorkerContext.from_config(config, rank, world_size, _device())
                    run_with_context(resolve(meta["train_loop"]), config, worker)
                except Exception as e:
                    result["failed_at"] = time.time()
                    text = last_line(str(e))
                    result["error"] = f"{type(e).__name__}: {text}" if text else type(e).__name__
                    traceback.print_exc()  # into the job's log
                finally:
                    # Leaving the group also frees peers blocked on this worker: their
                    # collectives fail now rather than at the collective timeout.
                    with contextlib.suppress(Exception):
                        if dist.is_initialized():
                            dist.destroy_process_group()
                    # The group's sockets close only when nothing holds it (DDP does, from
                    # the failed loop's frames): a peer waiting on this worker fails now.
                    gc.collect()
                    self._close_store()
                    result["clean"] = _writers_done(WRITER_WAIT_S)
        finally:
            with contextlib.suppress(Exception):
                ray.get(last_sent, timeout=LOG_FLUSH_S)
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        return result


@dataclass
class Member:
    """One worker of the pool."""

    actor: Any
    ready: Any  # the ref of its ``warm`` call: (node id, pid)
    node: str | None = None
    pid: int | None = None


@dataclass
class Ending:
    """How an attempt's runs ended, rank by rank, as they came in."""

    errors: list[tuple[int, str]] = field(default_factory=list)  # in the order they came
    dead: set[int] = field(default_factory=set)
    failed_at: float | None = None  # monotonic: the first failure the runner saw

    def failed(self, now: float) -> None:
        if self.failed_at is None:
            self.failed_at = now

    def outcome(self, stopped: bool) -> AttemptOutcome:
        if stopped:
            return AttemptOutcome(None, sorted(self.dead))
        if self.errors:
            rank, text = self.errors[0]
            return AttemptOutcome(f"rank {rank}: {text}"[:1000], sorted(self.dead))
        if self.dead:
            rank = min(self.dead)
            return AttemptOutcome(
                f"rank {rank}: its worker died (its process or its node was lost)",
                sorted(self.dead),
            )
        return AttemptOutcome()


def choose_warm(
    idle: list[Member], size: int, avoid: Collection[str]
) -> tuple[list[Member], list[Member]]:
    """Which warm workers an attempt of ``size`` trains on (in the pool's order, so rank 0
    stays where it was), and which go: those on ``avoid`` and those beyond ``size``."""
    usable = [m for m in idle if m.node not in avoid]
    return usable[:size], [m for m in idle if m.node in avoid] + usable[size:]


def settle_deadline(failed_at: float | None, settle_s: float = SETTLE_S) -> float | None:
    """Until when the runs still going may end by themselves: none before a failure."""
    return None if failed_at is None else failed_at + settle_s


class WarmPoolRunner:
    """The supervisor's side: the pool (``idle`` between attempts, ``busy`` in one) and
    one attempt at a time on it."""

    def __init__(self, plan: dict[str, Any], config_for: Any) -> None:
        self.plan = plan
        self.config_for = config_for  # AttemptSpec -> the train-loop config
        self.idle: list[Member] = []
        self.busy: dict[int, Member] = {}  # rank -> member, while its run goes on
        self.stopping = False
        self.closed = False
        self.stop_deadline: float | None = None  # monotonic: when stopped runs are killed
        self.stopped = asyncio.Event()

    # -- what the loop asks ------------------------------------------------------------------

    def warm_workers(self, exclude: Collection[str] = ()) -> int:
        """Workers the job holds between attempts (their slots are its own), leaving out
        those on ``exclude`` (nodes suspected lost, or draining)."""
        return sum(1 for m in self.idle if m.node not in exclude)

    def leave(self, ranks: set[int]) -> set[int]:
        return set()  # a restart leaves a draining node by pausing at a checkpoint

    def resize(self, size: int) -> set[int]:
        return set()  # a restart resizes by pausing at a step, then starting at the new size

    def stop(self) -> None:
        """End the running attempt: its workers still running get ``STOP_SETTLE_S`` to end
        by themselves (after a node loss their collectives fail within moments, and a worker
        that ends cleanly stays warm), then are killed (a loop cannot be interrupted from
        outside); those between attempts stay warm."""
        self.stopping = True
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + STOP_SETTLE_S
        self.stopped.set()
        for member in list(self.busy.values()):
            if member.node is None:  # still starting: nothing of it to keep warm
                self._kill(member)

    def let_go(self) -> None:
        """Between attempts: every idle worker goes, and its slot with it (the scheduler
        gave them to another job); later attempts place new ones."""
        idle, self.idle = self.idle, []
        for member in idle:
            self._kill(member)

    def close(self) -> None:
        """The job ended (or was cancelled): every worker goes, at once."""
        self.closed = True
        self.stop()
        for member in [*self.busy.values(), *self.idle]:
            self._kill(member)
        self.idle = []

    # -- the pool ----------------------------------------------------------------------------

    def _place(self) -> Member:
        resources = dict(self.plan["resources_per_worker"])
        actor = WarmWorker.options(  # type: ignore[attr-defined]
            num_cpus=resources.pop("CPU", 1),
            num_gpus=resources.pop("GPU", 0),
            resources=resources or None,
        ).remote()
        return Member(actor, actor.warm.remote(self.plan["train_loop"]))

    def _kill(self, member: Member) -> None:
        with contextlib.suppress(Exception):
            ray.kill(member.actor, no_restart=True)

    def _take(self, size: int, avoid: Collection[str]) -> list[Member]:
        """The attempt's workers: warm ones first (off ``avoid``), new ones for the rest."""
        members, let_go = choose_warm(self.idle, size, avoid)
        for member in let_go:
            self._kill(member)
        self.idle = []
        while len(members) < size:
            members.append(self._place())
        return members

    # -- one attempt -------------------------------------------------------------------------

    async def find_running(self) -> RunningAttempt | None:
        """Warm workers die with the supervisor that placed them: nothing to adopt."""
        return None

    async def adopt(self, running: RunningAttempt) -> AttemptOutcome:
        raise NotImplementedError("a restart-mode attempt ends with its supervisor")

    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        self.stopping = False
        self.stop_deadline = None
        self.stopped = asyncio.Event()
        members = self._take(spec.world_size, spec.avoid)
        self.busy = dict(enumerate(members))
        ending = Ending()
        try:
            if await self._warm_up(ending):
                await self._train(spec, ending)
        finally:
            for member in self.busy.values():  # not ended in time, or stopped
                self._kill(member)
            self.busy = {}
        return ending.outcome(self.stopping)

    async def _warm_up(self, ending: Ending) -> bool:
        """Wait until the new workers have imported what they need (bounded by the loop's
        start-up watch, which stops the attempt). False if one died meanwhile."""
        starting = [rank for rank, m in self.busy.items() if m.node is None]
        answers = await asyncio.gather(
            *(_awaited(self.busy[rank].ready) for rank in starting), return_exceptions=True
        )
        if self.stopping:
            return False
        for rank, answer in zip(starting, answers, strict=True):
            if isinstance(answer, BaseException):
                ending.dead.add(rank)
                self._kill(self.busy.pop(rank))
            else:
                self.busy[rank].node, self.busy[rank].pid = answer
        if ending.dead:  # a node went while its new worker started: the others stay warm
            ending.failed(time.monotonic())
            self._return_finished(set(self.busy))
            return False
        return True

    def _return_finished(self, ranks: set[int]) -> None:
        """These workers are done with the attempt and clean: back to the pool."""
        for rank in ranks:
            member = self.busy.pop(rank)
            if self.closed:
                self._kill(member)
            else:
                self.idle.append(member)

    async def _train(self, spec: AttemptSpec, ending: Ending) -> None:
        config = self.config_for(spec)
        timeout_s = float(self.plan["collective_timeout_s"])
        rank0 = self.busy[0]
        try:
            host, port = await rank0.actor.open_store.remote(spec.world_size, timeout_s)
        except ray.exceptions.RayError:
            if not self.stopping:
                ending.dead.add(0)
                ending.failed(time.monotonic())
                self._return_finished(set(self.busy) - {0})
            return
        runs: dict[asyncio.Future[Any], int] = {
            asyncio.ensure_future(
                _awaited(
                    m.actor.run.remote(
                        config,
                        rank,
                        spec.world_size,
                        host,
                        port,
                        self.plan["backend"],
                        timeout_s,
                    )
                )
            ): rank
            for rank, m in self.busy.items()
        }
        stop = asyncio.ensure_future(self.stopped.wait())
        try:
            await self._watch_runs(runs, stop, ending)
        finally:
            stop.cancel()
        if runs and not self.stopping:
            await self._classify_stuck(set(runs.values()), ending)

    async def _watch_runs(
        self,
        runs: dict[asyncio.Future[Any], int],
        stop: asyncio.Future[Any],
        ending: Ending,
    ) -> None:
        """Until every run ended, or the bound after a failure or a stop passed."""
        pings: dict[int, asyncio.Future[Any]] = {}
        ping_deadline: float | None = None
        while runs:
            if ending.failed_at is not None and ping_deadline is None and not self.stopping:
                # The first failure: is each worker still running alive? A dead one's call
                # may fail only once Ray learns of its node's death (seconds); its ping
                # gets no answer at once.
                ping_deadline = time.monotonic() + PING_S
                pings = {
                    rank: asyncio.ensure_future(_awaited(self.busy[rank].actor.ping.remote()))
                    for rank in runs.values()
                }
            deadlines = [
                d for d in (settle_deadline(ending.failed_at), self.stop_deadline) if d is not None
            ]
            if pings and ping_deadline is not None:
                deadlines.append(ping_deadline)
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            waiting = {*runs, *pings.values()} | (set() if stop.done() else {stop})
            done, _ = await asyncio.wait(
                waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            for fut in [f for f in runs if f in done]:
                rank = runs.pop(fut)
                pings.pop(rank, None)
                self._ended(rank, fut, ending)
            for rank, ping in list(pings.items()):
                if self.stopping:  # the supervisor ended the attempt: no one is counted dead
                    del pings[rank]
                    ping.cancel()
                elif ping.done() and ping.exception() is None:
                    del pings[rank]  # alive: its run ends by itself, within SETTLE_S
                elif ping.done() or time.monotonic() >= (ping_deadline or 0.0):
                    del pings[rank]
                    ping.cancel()
                    log.warning(
                        "worker %s (pid %s) does not answer after the attempt's failure: "
                        "counted dead",
                        rank,
                        self.busy[rank].pid,
                    )
                    ending.dead.add(rank)
                    for fut, r in list(runs.items()):
                        if r == rank:
                            del runs[fut]
                            fut.cancel()
                    self._kill(self.busy.pop(rank))
            deadline = settle_deadline(ending.failed_at)
            if deadline is not None and time.monotonic() >= deadline:
                break
            if self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
                break

    def _ended(self, rank: int, fut: asyncio.Future[Any], ending: Ending) -> None:
        member = self.busy[rank]
        try:
            result = fut.result()
        except ray.exceptions.RayActorError:
            if not self.stopping:
                ending.dead.add(rank)
                ending.failed(time.monotonic())
            self._kill(self.busy.pop(rank))
            return
        except ray.exceptions.RayError as e:  # our own code failed in the worker
            log.warning("worker %s (pid %s) failed: %s", rank, member.pid, e)
            ending.errors.append((rank, last_line(str(e)) or type(e).__name__))
            ending.failed(time.monotonic())
            self._kill(self.busy.pop(rank))
            return
        if result["error"] is not None:
            ending.errors.append((rank, result["error"]))
            ending.failed(time.monotonic())
        if result["clean"]:
            self._return_finished({rank})
        else:
            log.warning("worker %s (pid %s) left a checkpoint write running", rank, member.pid)
            self._kill(self.busy.pop(rank))

    async def _classify_stuck(self, ranks: set[int], ending: Ending) -> None:
        """Runs that did not end within SETTLE_S of the failure: a worker whose process does
        not answer is counted dead; every one of them is killed (by ``run``'s end)."""
        pings = {
            rank: asyncio.ensure_future(_awaited(self.busy[rank].actor.ping.remote()))
            for rank in ranks
        }
        await asyncio.wait(pings.values(), timeout=PING_S)
        for rank, ping in pings.items():
            answered = ping.done() and ping.exception() is None
            if not answered:
                ending.dead.add(rank)
            log.warning(
                "worker %s (pid %s) did not end within %s s of the attempt's failure%s",
                rank,
                self.busy[rank].pid,
                SETTLE_S,
                "" if answered else ", nor answers: counted dead",
            )
            ping.cancel()


async def _awaited(ref: Any) -> Any:
    return await ref
