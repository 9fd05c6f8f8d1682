"""Restart mode on warm workers: a pool of worker actors that outlive the job's attempts.

An attempt of a ``restart``-mode job is a process group formed by the pool's actors, one
per worker slot, each holding the job's ``resources_per_worker``: rank 0 opens a rendezvous
store bound to its node's Ray address, every rank joins the group through it and runs the
job's ``train_loop`` from the attempt's checkpoint, and leaves the group when the loop ends,
whatever happened. An actor imports torch, the training loop and the job's module once, when
it is placed, so the next attempt on it starts at once. A grow's new actors are placed and
warm up while the attempt trains (``warm_ahead``), so its pause starts on warm actors too.

When a node dies, its actors die with their raylet (``elastic/train/orphan.py``): the
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
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic import warm_processes
from elastic.cluster.reservation import Reservation
from elastic.restart.node_probe import NodeAnswer, NodeProbe
from elastic.restart.worker import WarmWorker
from elastic.supervisor.attempt import AttemptOutcome
from elastic.supervisor.runner import AttemptSpec, RunningAttempt, placement
from elastic.train.entrypoint import last_line
from elastic.train.worker_logs import FLUSH_S

log = logging.getLogger(__name__)


# After an attempt's first failure (a worker's error, or a worker that died), how long the
# other workers' runs may take to end: a survivor's loop raises at its next collective, and
# the call to a worker on a dead node fails once Ray gives up on its connection.
SETTLE_S = 5.0
# From an attempt's first failure (or the supervisor's stop), each worker still running is
# pinged, PING_EVERY_S after its last answer, until its run ends: a second node can die a
# moment after the first (one rack, one spot pool), after its worker answered a first ping.
# A live worker's second thread answers in milliseconds when the machine is quiet, but a busy
# machine can hold it for a second or more, so silence alone is no death: a ping silent for
# ASK_NODE_S has its node asked (``node_probe``), and asked again every ASK_NODE_S while
# it answers. A node that refuses has lost its raylet, and the worker is dead at once; one
# that does not answer at all (cut off, powered off) makes the worker dead once its ping was
# silent for PING_S; one that answers all along holds a live, slow worker, pinged again.
# One whose run did not end within SETTLE_S is asked again, and killed whatever it answers.
PING_EVERY_S = 0.1
ASK_NODE_S = 0.2
PING_S = 1.5
# After the supervisor stopped an attempt (Ray's membership lost one of its nodes, which
# can come before the survivors' own collective errors on a busy machine), how long the
# workers still running may take to end by themselves and stay warm before they are killed.
STOP_SETTLE_S = 3.0


@dataclass(eq=False)  # each member is itself: compared by identity
class Member:
    """One worker of the pool."""

    actor: Any
    ready: Any  # the ref of its ``warm`` call: (node id, pid)
    node: str | None = None
    pid: int | None = None
    group: Any = None  # the placement group of its slot, when a grow reserved one for it


@dataclass
class Ending:
    """How an attempt's runs ended, rank by rank, as they came in."""

    # (when it failed, rank, what it said). The earliest names the attempt's failure: a
    # worker that fails shuts its group's connections, so its peers fail a moment later
    # and their runs, quicker to return, may come back first.
    errors: list[tuple[float, int, str]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    failed_at: float | None = None  # monotonic: the first failure the runner saw
    code_error: bool = False  # a worker could not load the job's code
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> node, once placed

    def failed(self, now: float) -> None:
        if self.failed_at is None:
            self.failed_at = now

    def outcome(self, stopped: bool) -> AttemptOutcome:
        dead = sorted(self.dead)
        nodes = {r: self.nodes[r] for r in dead if r in self.nodes}
        if stopped:
            return AttemptOutcome(None, dead, dead_nodes=nodes)
        if self.errors:
            _, rank, text = min(self.errors, key=lambda e: e[0])
            return AttemptOutcome(
                f"rank {rank}: {text}"[:1000], dead, code_error=self.code_error, dead_nodes=nodes
            )
        if self.dead:
            return AttemptOutcome(
                f"rank {dead[0]}: its worker died (its process or its node was lost)",
                dead,
                dead_nodes=nodes,
            )
        return AttemptOutcome()


def choose_warm(
    idle: list[Member], size: int, avoid: Collection[str]
) -> tuple[list[Member], list[Member]]:
    """Which warm workers an attempt of ``size`` trains on (in the pool's order, so rank 0
    stays where it was), and which go: those on ``avoid`` and those beyond ``size``."""
    usable = [m for m in idle if m.node not in avoid]
    return usable[:size], [m for m in idle if m.node in avoid] + usable[size:]


def dead_by(node: NodeAnswer | None, silent_s: float) -> bool:
    """Whether a worker whose ping has been silent ``silent_s`` is dead, by its node's answer
    (None: not asked yet)."""
    if node is NodeAnswer.GONE:
        return True
    return node is NodeAnswer.SILENT and silent_s >= PING_S


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
        self.warming: list[Member] = []  # placed for a grow while an attempt trains
        self.stopping = False
        self.closed = False
        self.stop_deadline: float | None = None  # monotonic: when stopped runs are killed
        self.stopped = asyncio.Event()
        self.ending: Ending | None = None  # the running attempt's
        self.signalled = asyncio.Event()  # a worker of it reported a failure
        self.probe = NodeProbe()

    # -- what the loop asks ------------------------------------------------------------------

    def warm_workers(self, exclude: Collection[str] = ()) -> int:
        """Workers the job holds between attempts (their slots are its own), leaving out
        those on ``exclude`` (nodes suspected lost, or draining)."""
        return sum(1 for m in self.idle if m.node not in exclude)

    def leave(self, ranks: set[int]) -> set[int]:
        return set()  # a restart leaves a draining node by pausing at a checkpoint

    def replica_trained(self, index: int) -> None:
        """A worker of a restart is no joiner: there is nothing to mark."""

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

    def failure_signalled(self) -> None:
        """A worker of the running attempt said its loop failed (a collective lost a peer):
        the attempt's failure starts now, not when that worker's run returns, which it does
        only after its last checkpoint write and log lines are through (over a second on a
        busy machine). So the others are pinged from here on."""
        if self.ending is not None and not self.stopping:
            self.ending.failed(time.monotonic())
            self.signalled.set()

    def let_go(self) -> None:
        """Between attempts: every idle worker goes, and its slot with it (the scheduler
        gave them to another job); later attempts place new ones."""
        idle, self.idle = [*self.idle, *self.warming], []
        self.warming = []
        for member in idle:
            self._kill(member)

    def close(self) -> None:
        """The job ended (or was cancelled): every worker goes, at once."""
        self.closed = True
        self.stop()
        for member in [*self.busy.values(), *self.idle, *self.warming]:
            self._kill(member)
        self.idle, self.warming = [], []

    async def warm_ahead(self, slots: list[Reservation]) -> int:
        """Place a new worker in each slot reserved for the job's grow (one worker's
        placement group each, which lives as long as the worker: handed back, the slot could
        go to another job's pending reservation before the worker is placed) while the
        attempt trains, and wait until each has imported what it needs: the grow's pause is
        then a restart on warm workers only. Those ready join the workers held between
        attempts; returns how many did. An attempt that starts meanwhile takes them as they
        are (its start waits for them)."""
        members = [self._place(slot.handle) for slot in slots]
        self.warming += members
        answers = await asyncio.gather(
            *(_awaited(m.ready) for m in members), return_exceptions=True
        )
        ready = 0
        for member, answer in zip(members, answers, strict=True):
            if member not in self.warming:
                continue  # taken by an attempt, or gone with the pool
            self.warming.remove(member)
            if isinstance(answer, BaseException) or self.closed:
                self._kill(member)
                continue
            member.node, member.pid = answer
            self.idle.append(member)
            ready += 1
        return ready

    # -- the pool ----------------------------------------------------------------------------

    def _place(self, group: Any = None) -> Member:
        options = placement(self.plan["resources_per_worker"])
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, 0)
        if self.plan["ready_processes"]:
            options["runtime_env"] = warm_processes.TRAINING_ENV  # a node's ready process
        actor = WarmWorker.options(**options).remote()  # type: ignore[attr-defined]
        return Member(actor, actor.warm.remote(self.plan["train_loop"]), group=group)

    def _kill(self, member: Member) -> None:
        with contextlib.suppress(Exception):
            ray.kill(member.actor, no_restart=True)
        group, member.group = member.group, None
        if group is not None:  # its slot goes with it
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    def _take(self, size: int, avoid: Collection[str]) -> list[Member]:
        """The attempt's workers: warm ones first (off ``avoid``), then those still warming
        for a grow, new ones for the rest."""
        members, let_go = choose_warm(self.idle, size, avoid)
        warming, self.warming = self.warming, []
        while len(members) < size and warming:
            members.append(warming.pop(0))
        for member in [*let_go, *warming]:
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
        self.signalled = asyncio.Event()
        members = self._take(spec.world_size, spec.avoid)
        self.busy = dict(enumerate(members))
        ending = self.ending = Ending()
        try:
            if await self._warm_up(ending):
                await self._train(spec, ending)
        finally:
            for member in self.busy.values():  # not ended in time, or stopped
                self._kill(member)
            self.busy = {}
            self.ending = None
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
        ending.nodes = {r: m.node for r, m in self.busy.items() if m.node is not None}
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
        opened = asyncio.ensure_future(
            _awaited(rank0.actor.open_store.remote(spec.world_size, timeout_s))
        )
        # Its node may have died a moment ago, unknown to Ray's membership for seconds.
        lookout = asyncio.ensure_future(self._lookout(0))
        try:
            await asyncio.wait({opened, lookout}, return_when=asyncio.FIRST_COMPLETED)
            if not opened.done() and lookout.exception() is not None:
                await asyncio.wait({opened})  # the lookout failed, not the worker: Ray decides
        finally:
            lookout.cancel()
        if opened.done() and not isinstance(opened.exception(), ray.exceptions.RayError):
            host, port = opened.result()
        else:  # its worker died (Ray said so, or its lookout found it)
            opened.cancel()
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
        signalled = asyncio.ensure_future(self.signalled.wait())
        try:
            await self._watch_runs(runs, {stop, signalled}, ending, spec.attempt)
        finally:
            stop.cancel()
            signalled.cancel()
        if runs and not self.stopping:
            await self._classify_stuck(set(runs.values()), ending)
        elif runs and ending.failed_at is not None:
            # Stopped after a failure (Ray's membership saw the node leave first): the runs
            # still going are stuck as above, and what in goes into the job's log too.
            stuck_s = round(time.monotonic() - ending.failed_at, 1)
            for rank, stack in (await self._tell_where(set(runs.values()), stuck_s)).items():
                log.warning("worker %s is stuck at:\n%s", rank, stack)

    async def _watch_runs(
        self,
        runs: dict[asyncio.Future[Any], int],
        wakes: set[asyncio.Future[Any]],
        ending: Ending,
        attempt: int,
    ) -> None:
        """Until every run ended, or the bound after a failure or a stop passed; ``wakes``
        (a stop, a worker's failure signal) end a wait, once each. Until each worker has
        joined the attempt's group it is pinged too: a peer that dies before it joined
        leaves the others waiting in the join with no error, so a death then is the
        attempt's failure."""
        lookouts: dict[asyncio.Future[Any], int] = {}
        if not self.closed:
            lookouts = {
                asyncio.ensure_future(self._lookout(rank, joining=attempt)): rank
                for rank in runs.values()
            }
        abandoned = False
        try:
            while runs:
                over = ending.failed_at is not None or self.stopping
                if over and not abandoned:
                    # The attempt is over: the runs still going leave the collectives they
                    # wait in (or their join), rather than wait on a peer that failed and left.
                    abandoned = True
                    for rank in runs.values():
                        with contextlib.suppress(Exception):
                            self.busy[rank].actor.abandon.remote(attempt)
                    for lookout in lookouts:
                        lookout.cancel()
                    lookouts = {}
                    if not self.closed:
                        lookouts = {
                            asyncio.ensure_future(self._lookout(rank)): rank
                            for rank in runs.values()
                        }
                deadlines = [
                    d
                    for d in (settle_deadline(ending.failed_at), self.stop_deadline)
                    if d is not None
                ]
                timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                waiting = {*runs, *lookouts} | {w for w in wakes if not w.done()}
                done, _ = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for fut in [f for f in runs if f in done]:
                    rank = runs.pop(fut)
                    self._ended(rank, fut, ending)
                    for lookout, r in list(lookouts.items()):
                        if r == rank:
                            del lookouts[lookout]
                            lookout.cancel()
                for lookout in [f for f in lookouts if f in done]:
                    rank = lookouts.pop(lookout)
                    if lookout.cancelled() or lookout.exception() is not None or self.closed:
                        continue
                    if not lookout.result():
                        continue  # it joined the group: a death now fails a collective
                    log.warning(
                        "worker %s (pid %s) is lost, with its node or its process: counted dead",
                        rank,
                        self.busy[rank].pid,
                    )
                    ending.dead.add(rank)
                    if not self.stopping:
                        ending.failed(time.monotonic())
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
        finally:
            for lookout in lookouts:
                lookout.cancel()

    async def _lookout(self, rank: int, joining: int | None = None) -> bool:
        """Returns True once the worker of ``rank`` is found dead (see PING_EVERY_S); runs
        until cancelled while it answers. With ``joining`` (an attempt), it asks whether the
        worker joined that attempt's group instead, and returns False once it has."""
        member = self.busy[rank]
        while True:
            sent = time.monotonic()
            asked = (
                member.actor.ping.remote()
                if joining is None
                else member.actor.joined.remote(joining)
            )
            ping = asyncio.ensure_future(_awaited(asked))
            try:
                await asyncio.wait({ping}, timeout=ASK_NODE_S)
                node: NodeAnswer | None = None
                while not ping.done():
                    if node is not NodeAnswer.SILENT:  # silent once is enough (a handshake's wait)
                        node = await self.probe.ask(member.node) if member.node else NodeAnswer.GONE
                    silent_s = time.monotonic() - sent
                    if dead_by(node, silent_s):
                        return True
                    if node is NodeAnswer.UP and silent_s >= PING_S:
                        break  # its node there all along: alive, only slow
                    # A node that answered is asked again soon: it may be dying right now
                    # (its processes killed one by one).
                    left_s = max(0.0, sent + PING_S - time.monotonic())
                    wait_s = min(ASK_NODE_S, left_s) if node is NodeAnswer.UP else left_s
                    await asyncio.wait({ping}, timeout=wait_s)
                if ping.done() and ping.exception() is not None:
                    return True  # the actor is gone: Ray said so
                if joining is not None and ping.done() and ping.result():
                    return False
            finally:
                ping.cancel()
            await asyncio.sleep(PING_EVERY_S)

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
            ending.errors.append((time.time(), rank, last_line(str(e)) or type(e).__name__))
            ending.failed(time.monotonic())
            self._kill(self.busy.pop(rank))
            return
        if result["error"] is not None:
            ending.errors.append((result["failed_at"] or time.time(), rank, result["error"]))
            ending.code_error |= bool(result.get("code_error"))
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
        alive = {r for r, ping in pings.items() if ping.done() and ping.exception() is None}
        stacks = await self._tell_where(alive, SETTLE_S)
        for rank, ping in pings.items():
            if rank not in alive:
                ending.dead.add(rank)
            log.warning(
                "worker %s (pid %s) did not end within %s s of the attempt's failure%s%s",
                rank,
                self.busy[rank].pid,
                SETTLE_S,
                "" if rank in alive else ", nor answers: counted dead",
                f"; its training thread is at:\n{stacks[rank]}" if rank in stacks else "",
            )
            ping.cancel()

    async def _tell_where(self, ranks: set[int], after_s: float) -> dict[int, str]:
        """Live workers whose runs are stuck (most often in a collective): each one's training
        thread's stack, which it also prints into the job's log."""
        asked = {
            rank: asyncio.ensure_future(_awaited(self.busy[rank].actor.where.remote(rank, after_s)))
            for rank in ranks
        }
        if asked:
            await asyncio.wait(asked.values(), timeout=PING_S + FLUSH_S)
        stacks = {}
        for rank, answer in asked.items():
            if answer.done() and answer.exception() is None and answer.result():
                stacks[rank] = answer.result()
            answer.cancel()
        return stacks


async def _awaited(ref: Any) -> Any:
    return await ref
