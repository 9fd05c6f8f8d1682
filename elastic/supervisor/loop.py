"""The supervisor's loop: it routes a job between scheduling, running an attempt, and
deciding what an ended attempt means, asking the policies for every decision. It knows
the cluster only through a :class:`CapacitySource` and attempts only through an
:class:`AttemptRunner`, so it runs in unit tests without Ray.

The routing: ``schedule`` (wait for a size that fits, reserving it when the job first
starts) -> ``run`` (one attempt; a watcher ends it when a node goes, when its workers are
not placed in time, and reserves capacity to grow) -> ``schedule`` again after a pause or
a failure the restart policy retries, or the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from elastic.arrivals import InOrder
from elastic.checkpoint.directory import CheckpointInfo
from elastic.cluster.capacity import CapacitySource, Snapshot
from elastic.cluster.reservation import Reservation
from elastic.cluster.scheduling import Demand, Placement
from elastic.events import EventKind, EventLog, Resized, Restored, WorkerLost
from elastic.job_state import TERMINAL_STATES, JobState, check_transition
from elastic.supervisor.attempt import Attempt, AttemptOutcome, EndCause, Recovery
from elastic.supervisor.plan import SupervisorPlan
from elastic.supervisor.policy import (
    RestartPolicy,
    below_min_for_too_long,
    choose_world_size,
    decide_end,
    grow_target,
)
from elastic.supervisor.runner import AttemptRunner, AttemptSpec, RunningAttempt

log = logging.getLogger(__name__)


Step = Callable[[], Awaitable["Step | None"]]
# A worker's news: its kind, its data, (sender, number) when it was numbered, and when the
# worker sent it.
News = tuple[str, dict[str, Any], tuple[str, int] | None, float | None]


@dataclass(frozen=True)
class Timing:
    """Every wait of the loop has a bound; these are them."""

    poll_s: float = 2.0  # the longest wait for news of the cluster before looking again
    # A node whose workers died is left out of sizing until Ray's membership marks it dead,
    # or for this long: Ray takes seconds to notice a silent node, and a restart that tried
    # to place workers there would wait for them until the start-up bound.
    suspect_ttl_s: float = 60.0
    release_wait_s: float = 3.0  # for an ended attempt's survivors to free their resources
    reserve_s: float = 5.0  # to reserve capacity before starting or growing
    # From an attempt's start until all its workers have registered. It covers the start of
    # new worker processes too (each imports torch): several jobs that start at once
    # on a small, busy machine took over 60 s, and were sent back to the queue for nothing.
    start_s: float = 110.0
    stop_grace_s: float = 15.0  # for a stopped attempt's fit() to come back
    # For a node to answer after an attempt failed; a dead one is also declared dead by Ray
    # within this (3 s with the service's fast failure detection).
    probe_s: float = 5.0


class NoValidCheckpoint(Exception):
    pass


class CheckpointSource(Protocol):
    def latest_valid(self) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]: ...


class JobLoop:
    def __init__(
        self,
        plan: SupervisorPlan,
        runner: AttemptRunner,
        capacity: CapacitySource,
        checkpoints: CheckpointSource,
        events: EventLog,
        timing: Timing = Timing(),
        clock: Callable[[], float] = time.time,
        storage_check: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        self.plan = plan
        self.runner = runner
        self.capacity = capacity
        self.checkpoints = checkpoints
        self.events = events
        self.timing = timing
        self.clock = clock
        # Why the job's checkpoint location cannot serve it (None: it can), asked once at
        # start: a location only some nodes see would lose every checkpoint to a restart.
        self.storage_check = storage_check
        self.state = JobState(plan.initial_state)
        self.restarts = RestartPolicy(plan.max_restarts)
        self.furthest_step = plan.last_step  # see ``SupervisorPlan.own_checkpoints``
        self.attempt: Attempt | None = None
        self.recovery: Recovery | None = None
        self.reservation: Reservation | None = None
        self.suspects: dict[str, float] = {}
        self.version = -1
        self.cancelled = False
        self.waiting_for: str | None = None
        self._claim_settled = False
        # Since when a grow the scheduler decided has found only part of its workers free.
        self._short_grow_since: float | None = None
        # A grow's new workers being placed and warmed while the attempt trains.
        self._warming: asyncio.Future[None] | None = None
        # A drain notice for nodes of the running attempt: (attempt number, those nodes).
        # The attempt pauses at its next checkpoint and the job goes on without them.
        self.draining: tuple[int, frozenset[str]] | None = None
        # The latest throughput measured at each size, not yet told to the scheduler.
        self.throughput: dict[int, float] = {}
        self.replicas: int | None = None  # in place: the scheduler's size at the start
        # The workers' news, back in the order each sent it (see elastic.arrivals).
        self.arrivals: InOrder[News] = InOrder(clock=clock, taken=plan.delivered)
        # A re-created supervisor holds what workers say until it knows whether it adopts
        # their attempt: replicas that outlived its predecessor call it as soon as it exists.
        self._held: list[Callable[[], None]] | None = [] if plan.recreated else None

    # -- the routing -------------------------------------------------------------------------

    async def run(self) -> None:
        step: Step | None = self._start
        try:
            while step is not None and self.state not in TERMINAL_STATES:
                step = await step()
        except Exception as e:  # a bug here must still end the job where a user sees it
            log.exception("supervisor of %s failed", self.plan.job_id)
            if self.state not in TERMINAL_STATES:
                self._set_state(JobState.FAILED, reason=f"supervisor error: {e!r}")
        finally:
            await self._drop_reservation()
            self.runner.close()  # warm workers outlive attempts, not the job
            with contextlib.suppress(Exception):  # it also forgets a supervisor that died
                await self.capacity.unregister()

    async def _start(self) -> Step | None:
        if self.storage_check is not None:
            problem = await self.storage_check()
            if problem is not None:
                self._set_state(JobState.FAILED, reason=problem)
                return None
        if self.plan.recreated:
            running = await self.runner.find_running()
            if running is not None:
                await self.capacity.register(self._demand())
                return functools.partial(self._adopt, running)
            self._held = None  # a new attempt begins: what the lost one's workers said is moot
            self._resume_after_supervisor_loss()
        await self.capacity.register(self._demand())
        return self._schedule

    async def _schedule(self) -> Step | None:
        began = time.monotonic()
        short_since: float | None = None  # since when the scheduler's size is not all free
        wait = False  # the first look takes the snapshot at hand; later ones wait for news
        while not self.cancelled:
            snap = await self._next_snapshot(wait)
            wait = True
            fit = self._fit(snap)
            decided = snap.target
            if decided is not None and not decided.fits:
                # Not even its minimum packs into what is left of the cluster (nodes were
                # lost): a shortage, as without a scheduler, with its grace while recovering.
                decided = None
            cap = (
                self.plan.max_workers
                if decided is None
                else min(decided.size, self.plan.max_workers)
            )
            if cap < self.plan.min_workers:
                # The scheduler holds it back (its queue, a quota, a job of higher priority):
                # it waits as a queued job, and the grace for lost workers does not run.
                assert decided is not None
                if self.state == JobState.RECOVERING:  # its recovery spans the wait
                    self._set_state(JobState.QUEUED, reason=decided.reason)
                self._waiting(decided.reason)
                continue
            size = choose_world_size(self.plan.min_workers, cap, fit)
            self.replicas = None if decided is None else cap
            if size is None:
                if self.state == JobState.RECOVERING and below_min_for_too_long(
                    time.monotonic() - began, self.plan.min_workers_grace_s
                ):
                    self._set_state(JobState.FAILED, reason=self._too_few(fit, grace=True))
                    return None
                self._waiting(self._too_few(fit, grace=False))
                continue
            if decided is not None and size < cap and self.state == JobState.QUEUED:
                # The scheduler counted workers that an ended or shrinking job is still
                # handing back to Ray: a moment's wait starts this job at its planned size,
                # rather than small and grown (a restart, in restart mode) seconds later.
                short_since = time.monotonic() if short_since is None else short_since
                if time.monotonic() - short_since < self.timing.release_wait_s:
                    continue
            if self.state == JobState.QUEUED and self.reservation is None:
                # Two queued jobs may both see the same free slots: the reservation decides
                # which one starts; the other stays queued and says why.
                self.reservation = await self.capacity.reserve(
                    size, self.plan.resources_per_worker, self.timing.reserve_s
                )
                if self.reservation is None:
                    self._waiting(f"{size} free worker slots went to another job; waiting")
                    continue
            return functools.partial(self._run, size)
        return None

    async def _run(self, size: int) -> Step | None:
        try:
            checkpoint = await self._latest_checkpoint()
        except NoValidCheckpoint:
            await self._drop_reservation()
            return None
        if self.reservation is not None:
            # Handed to this attempt's workers: its new ones take what it frees.
            reservation, self.reservation = self.reservation, None
            await self.capacity.release(reservation, hand_over=True)
        attempt = self._begin(size, checkpoint)
        spec = AttemptSpec(
            attempt.number,
            size,
            checkpoint.path if checkpoint else None,
            frozenset(self.suspects),
            self.replicas,
        )
        return await self._supervise(attempt, self.runner.run(spec))

    async def _adopt(self, running: RunningAttempt) -> Step | None:
        """In place, the lost supervisor's attempt outlived it (its replicas train on): this
        supervisor goes on watching it, under its number, with no restart."""
        attempt = Attempt(running.number, running.world_size, None, self.clock())
        attempt.saw_step(self.plan.last_step, self.plan.last_step)
        attempt.running = self.state == JobState.RUNNING
        self.attempt = attempt
        self.replicas = running.replicas
        self._emit(
            EventKind.SUPERVISOR_RECREATED,
            {"previous_state": self.state, "adopted_attempt": running.number},
        )
        held, self._held = self._held or [], None
        for call in held:
            call()
        return await self._supervise(attempt, self.runner.adopt(running))

    async def _supervise(self, attempt: Attempt, run: Awaitable[AttemptOutcome]) -> Step | None:
        running = asyncio.ensure_future(run)
        watch = self._watch_in_place if self.plan.fault_tolerance == "in_place" else self._watch
        watcher = asyncio.ensure_future(watch(attempt))
        try:
            await asyncio.wait({running, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not running.done():  # the watcher stopped the attempt: bound the wait for it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(running), self.timing.stop_grace_s)
        finally:
            attempt.ended = True  # a cancel can be lost in a wait_for (bpo-42130): say it twice
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if not self._claim_settled:  # never placed: what was handed over is free for all
            await self.capacity.settle()
        if running.done() and not running.cancelled():
            outcome = running.result()
        else:
            running.cancel()
            outcome = AttemptOutcome(attempt.stop_reason or "the attempt did not end when told")
        return await self._after(attempt, outcome)

    async def _after(self, attempt: Attempt, outcome: AttemptOutcome) -> Step | None:
        if self.cancelled:
            return None
        # What the attempt's workers said is all weighed before deciding what its end means.
        self._deliver(self.arrivals.release_all())
        stopped_as = attempt.stop_cause
        for rank, node in outcome.dead_nodes.items():
            attempt.worker_nodes.setdefault(rank, node)
        found: set[str] = set()
        if stopped_as == EndCause.NODE_LOST or (stopped_as is None and outcome.error is not None):
            found = await self._lost_nodes(attempt, outcome.dead_ranks)
        end = decide_end(
            stopped_as,
            outcome.error,
            attempt.paused_at,
            attempt.checkpoint_step,
            attempt.shrink is not None,
            found,
            self._drained(attempt),
            outcome.code_error,
        )
        attempt.paused_at = end.paused_at
        if end.left_drained:  # the checkpoint it paused at is verified like any other
            log.info(
                "job %s: its worker group failed as it left drained nodes, "
                "after its pause at step %s",
                self.plan.job_id,
                attempt.paused_at,
            )
        cause, lost = end.cause, set(end.lost)
        if cause == EndCause.FINISHED:
            await self._drop_reservation()
            if self.state in (JobState.STARTING, JobState.RECOVERING):
                # A custom loop may finish without ever reporting a step: it did run.
                self._set_state(JobState.RUNNING, world_size=attempt.world_size)
            self._set_state(JobState.SUCCEEDED, step=attempt.reached_step)
            return None
        now = self.clock()
        if cause == EndCause.PAUSED:
            step = attempt.paused_at or 0
            nodes = self._drained(attempt)
            if nodes:
                self.draining = None
                for node in nodes:  # out of sizing until Ray drops it, like a suspect
                    self.suspects[node] = now
                self.recovery = Recovery("drain", attempt.world_size, step, now, now)
                leaving = sum(n in nodes for n in attempt.worker_nodes.values())
                await self._wait_for_release(attempt.world_size - leaving)
                return self._schedule
            if attempt.shrink is not None:
                return await self._shrunk(attempt, attempt.shrink, step, now)
            self.recovery = Recovery("grow", attempt.world_size, step, now, now)
            self.recovery.decision = attempt.grow_reason
            await self._wait_for_release(attempt.grow_to or attempt.world_size)
            return self._schedule
        return await self._failed(attempt, cause, attempt.stop_reason or outcome.error, lost, now)

    async def _shrunk(
        self, attempt: Attempt, decided: Placement, step: int, now: float
    ) -> Step | None:
        """Paused for the scheduler: go on smaller, or, preempted, give every worker back and
        wait in the queue; either way from the checkpoint of the step it paused at."""
        if decided.size >= self.plan.min_workers:
            self.recovery = Recovery("shrink", attempt.world_size, step, now, now)
            self.recovery.decision = decided
            return self._schedule
        self.runner.let_go()  # its warm workers' slots are what the other job waits for
        self.recovery = Recovery("preempt", attempt.world_size, step, now, now)
        self._set_state(JobState.QUEUED, reason=decided.reason, checkpoint_step=step)
        return self._schedule

    async def _failed(
        self, attempt: Attempt, cause: EndCause, reason: str | None, lost: set[str], now: float
    ) -> Step | None:
        reason = reason or cause.value
        detected = attempt.detected_at or now
        for node in lost:
            self.suspects[node] = now
        if self.recovery is None or self.recovery.kind == "grow":
            self.recovery = Recovery(
                "loss" if lost else "failure",
                attempt.world_size,
                attempt.completed_step,
                attempt.first_signal_at or detected,
                detected,
            )
        else:  # one more attempt on the way: the recovery spans them all
            self.recovery.attempts += 1
            self.recovery.completed_step = max(self.recovery.completed_step, attempt.completed_step)
        if lost:
            ranks = sorted(r for r, n in attempt.worker_nodes.items() if n in lost)
            loss = self.recovery.as_event(
                WorkerLost,
                None,
                None,
                from_world=attempt.world_size,  # this attempt's: the recovery's may be earlier
                nodes=tuple(sorted(lost)),
                ranks=tuple(ranks),
                reason=reason,
            )
            self._emit(loss.KIND, loss.data())
        further = attempt.completed_step > self.furthest_step
        self.furthest_step = max(self.furthest_step, attempt.completed_step)
        progressed = attempt.saved_checkpoint or (further and self.plan.own_checkpoints)
        decision = self.restarts.decide(cause, progressed)
        if not decision.retry:
            await self._drop_reservation()
            self._set_state(JobState.FAILED, reason=f"{reason} ({decision.reason})")
            return None
        if cause == EndCause.START_TIMEOUT and self.state == JobState.STARTING:
            # It never ran: it waits for capacity again, as a queued job, and says why.
            await self._drop_reservation()
            self.recovery = None
            self._set_state(JobState.QUEUED, reason=reason)
            return self._schedule
        if self.state != JobState.RECOVERING:
            self._set_state(JobState.RECOVERING, reason=reason, restarts=self.restarts.restarts)
        await self._wait_for_release(attempt.world_size - len(lost))
        return self._schedule

    # -- watching a running attempt ------------------------------------------------------------

    async def _watch(self, attempt: Attempt) -> None:
        """End the attempt as soon as Ray's membership loses one of its nodes (a silent loss
        raises no collective error until its timeout) or its workers are not all placed in
        time, and reserve capacity to grow when some appears."""
        deadline = time.monotonic() + self.timing.start_s
        self._claim_settled = False
        while not attempt.ended:
            snap = await self._next_snapshot()
            gone = {n for n in attempt.worker_nodes.values() if n not in snap.alive}
            if attempt.paused_at is not None:
                # Pausing (its checkpoint is published before the workers stop): a drained
                # node may go as soon as its workers are done, which is no loss.
                if gone & self._drained(attempt):
                    log.info("job %s: the drained nodes left as it paused", self.plan.job_id)
                gone -= self._drained(attempt)
            if gone:
                names = ", ".join(sorted(g[:12] for g in gone))
                self._stop(
                    attempt,
                    EndCause.NODE_LOST,
                    f"node{'s' if len(gone) > 1 else ''} {names} left the cluster",
                )
                return
            if not attempt.all_placed:
                if time.monotonic() > deadline:
                    self._stop(
                        attempt,
                        EndCause.START_TIMEOUT,
                        f"only {len(attempt.worker_nodes)} of {attempt.world_size} workers "
                        f"started within {self.timing.start_s:g} s",
                    )
                    return
                continue
            if not self._claim_settled:
                self._claim_settled = True
                await self.capacity.settle()
            await self._tell_throughput()
            if attempt.paused_at is not None:
                continue  # it is ending: nothing more to notice, nor to grow by
            self._notice_drain(attempt, snap)
            self._notice_shrink(attempt, snap)
            await self._maybe_reserve_growth(attempt, snap)

    def _notice_drain(self, attempt: Attempt, snap: Snapshot) -> None:
        """A drain notice (a spot preemption, a scale-down) for a node of this attempt: it
        pauses at its next step with a checkpoint of it, before the node goes, so no step is
        redone."""
        drained = frozenset(n for n in attempt.worker_nodes.values() if n in snap.draining)
        # Looked at on every poll: a second node drained later is left at the same pause.
        if not drained or drained <= self._drained(attempt):
            return
        self.draining = (attempt.number, drained | self._drained(attempt))
        deadlines = [snap.draining[n] for n in drained if snap.draining[n] > 0]
        log.info(
            "job %s: nodes %s are draining (deadline %s ms); pausing at the next checkpoint",
            self.plan.job_id,
            sorted(drained),
            min(deadlines) if deadlines else None,
        )

    def _notice_shrink(self, attempt: Attempt, snap: Snapshot) -> None:
        """The scheduler wants workers of this attempt for another job (or all of them, to
        preempt it): it pauses at its next step with a checkpoint of it, like a drain."""
        decided = snap.target
        if (
            decided is None
            or not decided.fits  # a cluster too small for its minimum is a loss, not an order
            or decided.for_job is None  # a node lost or draining: that path handles it
            or attempt.shrink is not None
            or decided.size >= attempt.world_size
            or self.state != JobState.RUNNING
        ):
            return
        attempt.shrink = decided
        self._tell_scheduled(decided, attempt.world_size, max(0, decided.size))
        log.info(
            "job %s: the scheduler wants %s of its %s workers (%s); pausing at the next step",
            self.plan.job_id,
            decided.size,
            attempt.world_size,
            decided.reason,
        )

    def _drained(self, attempt: Attempt) -> frozenset[str]:
        """The attempt's nodes that a drain notice is for (it pauses to leave them)."""
        if self.draining is not None and self.draining[0] == attempt.number:
            return self.draining[1]
        return frozenset()

    async def _watch_in_place(self, attempt: Attempt) -> None:
        """In place, a node loss ends nothing: the replicas' quorum goes on without it and
        the runner places replacements that wait for capacity. Only what was handed over at
        the start is settled once the first replicas are placed."""
        self._claim_settled = False
        told = self.replicas
        while not attempt.ended:
            snap = await self._next_snapshot()
            if not self._claim_settled and attempt.all_placed:
                self._claim_settled = True
                await self.capacity.settle()
            await self._tell_throughput()
            self._leave_draining_nodes(attempt, snap)
            decided = snap.target
            if (
                decided is None
                or not decided.fits
                or told is None
                or self.state != JobState.RUNNING
            ):
                continue  # (a cluster too small for its minimum is a loss, not an order)
            size = min(decided.size, self.plan.max_workers)
            if size < self.plan.min_workers:  # preempted: every replica leaves at a step
                if attempt.shrink is None:
                    attempt.shrink = decided
                    self._tell_scheduled(decided, told, 0)
                    self.runner.resize(0)
                continue
            if size > told or (size < told and decided.for_job is not None):
                # A shrink for nobody is the cluster losing a node: the runner already
                # replaces the lost replica, waiting for capacity, as without a scheduler.
                self._tell_scheduled(decided, told, size)
                self.runner.resize(size)
                told = size

    def _tell_scheduled(self, decided: Placement, from_world: int, to_world: int) -> None:
        self._emit(
            EventKind.SCHEDULED,
            {
                "change": decided.change.value,
                "from_world": from_world,
                "to_world": to_world,
                "reason": decided.reason,
                "for_job": decided.for_job,
            },
        )

    def _leave_draining_nodes(self, attempt: Attempt, snap: Snapshot) -> None:
        """In place, a drain notice needs no pause: the replicas on the draining nodes leave
        the quorum at their next step boundary and the others train on without them."""
        leaving = {r: n for r, n in attempt.worker_nodes.items() if n in snap.draining}
        if not leaving:
            return
        told = self.runner.leave(set(leaving))
        for rank in leaving:
            del attempt.worker_nodes[rank]
        log.info(
            "job %s: replicas %s leave the draining nodes %s",
            self.plan.job_id,
            sorted(told),
            sorted(set(leaving.values())),
        )

    async def _maybe_reserve_growth(self, attempt: Attempt, snap: Snapshot) -> None:
        if (
            self.state != JobState.RUNNING
            or self.recovery is not None
            or attempt.grow_to is not None
            or self._warming is not None
            or attempt.world_size >= self.plan.max_workers
        ):
            return
        free = snap.workers_free(self.plan.resources_per_worker, self.suspects)
        decided = snap.target
        most = (
            self.plan.max_workers if decided is None else min(decided.size, self.plan.max_workers)
        )
        target = grow_target(attempt.world_size, most, free)
        if target is None or attempt.shrink is not None:
            self._short_grow_since = None
            return
        if target < most:
            # Another job's workers go back to Ray one by one: a moment's wait grows this job
            # in one pause (a restart) rather than two, seconds apart.
            now = time.monotonic()
            self._short_grow_since = self._short_grow_since or now
            if now - self._short_grow_since < self.timing.release_wait_s:
                return
        self._short_grow_since = None
        # One reservation per new worker: each worker holds its own slot from its placement
        # on, and gives it back when it goes.
        extra = target - attempt.world_size
        slots = await asyncio.gather(
            *(
                self.capacity.reserve(1, self.plan.resources_per_worker, self.timing.reserve_s)
                for _ in range(extra)
            )
        )
        held = [slot for slot in slots if slot is not None]
        if len(held) < extra or attempt is not self.attempt or self.cancelled:
            for slot in held:
                await self.capacity.release(slot, hand_over=False)
            return
        # Only now, with the capacity held for this job, is a grow worth it. Its new workers
        # are placed on the reserved slots at once and warm up (a process, torch, the loop:
        # seconds) while the attempt trains; the pause comes once they are ready.
        self._warming = asyncio.ensure_future(self._grow_when_warm(attempt, held, decided))

    async def _grow_when_warm(
        self, attempt: Attempt, slots: list[Reservation], decided: Placement | None
    ) -> None:
        """Pause to grow once the new workers are ready (those that are not never count)."""
        try:
            ready = await self.runner.warm_ahead(slots)
        except Exception:
            log.exception("%s: warming workers to grow", self.plan.job_id)
            return
        finally:
            self._warming = None
        if (
            ready == 0
            or attempt is not self.attempt
            or attempt.ended
            or attempt.paused_at is not None
            or attempt.stop_cause is not None
            or self.cancelled
        ):
            return  # those ready wait, warm, for the next attempt
        attempt.grow_to = min(attempt.world_size + ready, self.plan.max_workers)
        attempt.grow_reason = decided
        if decided is not None:
            self._tell_scheduled(decided, attempt.world_size, attempt.grow_to)

    def _stop(self, attempt: Attempt, cause: EndCause, reason: str) -> None:
        now = self.clock()
        if cause == EndCause.NODE_LOST:
            attempt.saw_failure(now)
        attempt.detected_at = now
        attempt.stop_cause, attempt.stop_reason = cause, reason
        self.runner.stop()

    # -- what the workers and the reader say ---------------------------------------------------

    def register_worker(self, attempt: int, rank: int, node_id: str) -> None:
        if self._held is not None:
            self._held.append(functools.partial(self.register_worker, attempt, rank, node_id))
            return
        if self.attempt is not None and attempt == self.attempt.number:
            self.attempt.worker_nodes[rank] = node_id

    def replica_trained(self, attempt: int, replica: int) -> None:
        """In place: a replica of this attempt committed its first step."""
        if self._held is not None:
            self._held.append(functools.partial(self.replica_trained, attempt, replica))
            return
        if self.attempt is not None and attempt == self.attempt.number:
            self.runner.replica_trained(replica)

    def should_pause(self, attempt: int, step: int) -> bool:
        """Asked by rank 0 right after each checkpoint: stop here so the job can grow, or leave
        a draining node?"""
        current = self.attempt
        if current is None or attempt != current.number:
            return False
        if not self._pausing(current) or self.cancelled:
            return False
        current.paused_at = step
        return True

    def _pausing(self, attempt: Attempt) -> bool:
        """The attempt is to pause: to grow, to leave a draining node, or to shrink."""
        return (
            attempt.grow_to is not None
            or bool(self._drained(attempt))
            or attempt.shrink is not None
        )

    def drain_pending(self, attempt: int) -> bool:
        """Polled by rank 0: is a node of this attempt draining? Its workers then pause at
        their next step, with a checkpoint of that step, rather than at the next scheduled
        checkpoint, which may come after the node is gone."""
        current = self.attempt
        if current is None or attempt != current.number or self.cancelled:
            return False
        return bool(self._drained(current)) or current.shrink is not None

    def record(
        self,
        kind: str,
        data: dict[str, Any],
        sender: str | None = None,
        n: int | None = None,
        at: float | None = None,
    ) -> None:
        """A worker's news; numbered news (``sender``, ``n``) is taken in the order it was
        sent, which is not always the order Ray delivers it; ``at``: when it was sent, the
        time its event shows."""
        if self._held is not None:
            self._held.append(functools.partial(self.record, kind, data, sender, n, at))
            return
        if sender is None or n is None:
            self._record(kind, data)
            return
        if n <= self.plan.delivered.get(sender, -1):
            return  # sent again after its supervisor's loss; the service has it already
        self._deliver(self.arrivals.accept(sender, n, (kind, data, (sender, n), at)))
        self.deliver_overdue()

    def deliver_overdue(self) -> None:
        """Take the news held behind a call that has not come in time (see elastic.arrivals)."""
        self._deliver(self.arrivals.overdue())

    def _deliver(self, news: list[News]) -> None:
        for kind, data, origin, at in news:
            self._record(kind, data, origin, at)

    def _record(
        self,
        kind: str,
        data: dict[str, Any],
        origin: tuple[str, int] | None = None,
        at: float | None = None,
    ) -> None:
        current = self.attempt
        if current is None or data.get("attempt") != current.number or self.cancelled:
            return  # late news from an attempt that has already ended
        try:
            what = EventKind(kind)
        except ValueError:
            log.warning("unknown event kind %r from a worker of %s", kind, self.plan.job_id)
            return
        completed = data.get("completed_step")
        if what == EventKind.FAILURE_SIGNAL:
            current.saw_failure(float(data.get("time") or self.clock()))
            self.runner.failure_signalled()
            if completed is not None:
                current.saw_step(int(completed), int(completed))
            return
        if what == EventKind.METRICS:
            if not current.first_report(int(data.get("step", 0))):
                return  # sent again by a replica that became the reporter: logged already
            done = None if completed is None else int(completed)
            rate, world = data.get("samples_per_s"), data.get("world_size")
            # Two steps' rates are not the job's at this size, and are not told to the
            # scheduler: an attempt's first (it also builds what later steps reuse: DDP's
            # buckets, the loader's iterator), which made a job that gains from a worker look
            # as if it did not; and the steps after a pause was asked (the last waits for the
            # checkpoint), which made a job that does not gain look as if it did, so that it
            # kept a worker another job needed.
            if rate and world and current.running and not self._pausing(current):
                self.throughput[int(world)] = float(rate)
            current.saw_step(int(data.get("step", 0)), done)
            if not current.running:
                current.running = True
                if self.state in (JobState.STARTING, JobState.RECOVERING):
                    self._set_state(JobState.RUNNING, world_size=data.get("world_size"))
                if self.recovery is not None:
                    self._complete_recovery(current)
        elif what == EventKind.CHECKPOINT_SAVED:
            step = int(data["step"])
            current.checkpoint_step = step
            current.saved_checkpoint = True
            current.saw_step(step, step if completed is None else int(completed))
        self._emit(what, data, origin, at)

    def cancel(self, reason: str) -> str:
        if self.state in TERMINAL_STATES:
            return self.state
        self.cancelled = True
        # The job ends here: warm workers go at once, not after a stop's grace.
        self.runner.close()
        self._set_state(JobState.CANCELLED, reason=reason)
        return self.state

    def status(self) -> dict[str, Any]:
        a = self.attempt
        return {
            "state": self.state,
            "attempt": a.number if a else 0,
            "world_size": a.world_size if a else 0,
            "step": a.reached_step if a else 0,
            "pending": len(self.events),
            "worker_nodes": dict(a.worker_nodes) if a else {},
            "restarts_without_progress": self.restarts.restarts,
        }

    # -- helpers ---------------------------------------------------------------------------

    def _begin(self, size: int, checkpoint: CheckpointInfo | None) -> Attempt:
        step = checkpoint.step if checkpoint else None
        if self.recovery is not None:
            self.recovery.checkpoint_step = step
        number = self.attempt.number + 1 if self.attempt else self.plan.first_attempt
        self.attempt = Attempt(number, size, step, self.clock())
        if self.state == JobState.QUEUED:
            self._set_state(JobState.STARTING, world_size=size)
        self.waiting_for = None
        self._emit(
            EventKind.ATTEMPT_STARTED,
            {"attempt": number, "world_size": size, "checkpoint_step": step},
        )
        return self.attempt

    def _resume_after_supervisor_loss(self) -> None:
        info, _ = self.checkpoints.latest_valid()
        step = info.step if info else None
        self._emit(
            EventKind.SUPERVISOR_RECREATED,
            {"previous_state": self.state, "checkpoint_step": step},
        )
        if self.state not in (JobState.RUNNING, JobState.STARTING, JobState.RECOVERING):
            return
        now = self.clock()
        self.recovery = Recovery(
            "failure", self.plan.last_world_size, self.plan.last_step, now, now
        )
        if self.state != JobState.RECOVERING:
            self._set_state(
                JobState.RECOVERING,
                reason="the job's supervisor was lost; a new one resumes it"
                + (
                    f" from the checkpoint of step {step}"
                    if step is not None
                    else f" from step 0 (no checkpoint was saved; step {self.plan.last_step}"
                    " was reached)"
                ),
                restarts=0,
            )

    async def _latest_checkpoint(self) -> CheckpointInfo | None:
        """The checkpoint to start from. When checkpoints exist but none is valid, the job
        fails (:class:`NoValidCheckpoint`): it must not silently start over from step 0."""
        info, skipped = await asyncio.to_thread(self.checkpoints.latest_valid)
        for bad, why in skipped:
            self._emit(
                EventKind.CHECKPOINT_CORRUPT, {"step": bad.step, "path": bad.path, "reason": why}
            )
        if info is None and skipped:
            steps = ", ".join(str(bad.step) for bad, _ in skipped)
            self._set_state(
                JobState.FAILED,
                reason=f"no valid checkpoint is left (steps {steps} fail verification); "
                "the job does not start over from step 0",
            )
            raise NoValidCheckpoint
        return info

    async def _next_snapshot(self, wait: bool = True) -> Snapshot:
        if wait:
            snap = await self.capacity.snapshot(self.version, self.timing.poll_s)
        else:
            snap = await self.capacity.snapshot()
        self.version = snap.version
        now = self.clock()
        self.suspects = {
            n: t
            for n, t in self.suspects.items()
            if n in snap.alive and now - t < self.timing.suspect_ttl_s
        }
        return snap

    async def _wait_for_release(self, expected: int) -> None:
        """Give the ended attempt's surviving workers a moment to hand back their resources,
        so the restart is not needlessly small."""
        deadline = time.monotonic() + self.timing.release_wait_s
        want = min(self.plan.max_workers, expected)
        snap = await self.capacity.snapshot()  # warm workers released nothing: maybe no wait
        while not self.cancelled:
            self.version = max(self.version, snap.version)
            if self._fit(snap) >= want or time.monotonic() >= deadline:
                return
            snap = await self.capacity.snapshot(self.version, deadline - time.monotonic())

    def _fit(self, snap: Snapshot) -> int:
        """Workers this job can have now: the free slots, the capacity reserved for it, and
        the warm workers it holds between attempts (off suspected nodes)."""
        held = self.reservation.workers if self.reservation else 0
        free = snap.workers_free(self.plan.resources_per_worker, self.suspects)
        return free + held + self._warm()

    def _warm(self) -> int:
        return self.runner.warm_workers(self.suspects)

    async def _lost_nodes(self, attempt: Attempt, dead_ranks: list[int]) -> set[str]:
        """The attempt's nodes that are gone: by Ray's membership, by a worker process that
        died there, or by not answering a probe (the membership lags by seconds)."""
        snap = await self.capacity.snapshot()
        nodes = set(attempt.worker_nodes.values())
        gone = {n for n in nodes if n not in snap.alive}
        gone |= {attempt.worker_nodes[r] for r in dead_ranks if r in attempt.worker_nodes}
        if not gone:  # an error with no loss in sight: is a node silently gone?
            gone = await self.capacity.unreachable(nodes, self.timing.probe_s)
        return gone

    def _demand(self) -> Demand:
        p = self.plan
        return Demand(
            job_id=p.job_id,
            owner=p.owner,
            priority=p.priority,
            min_workers=p.min_workers,
            max_workers=p.max_workers,
            per_worker=dict(p.resources_per_worker),
            submitted_at=p.submitted_at,
            resize=p.fault_tolerance,
        )

    async def _tell_throughput(self) -> None:
        """What was measured since last time, for the scheduler's sharing of spare workers."""
        measured, self.throughput = self.throughput, {}
        for world, rate in measured.items():
            await self.capacity.observe(world, rate)

    async def _drop_reservation(self) -> None:
        if self.reservation is not None:
            reservation, self.reservation = self.reservation, None
            await self.capacity.release(reservation, hand_over=False)

    def _too_few(self, fit: int, grace: bool) -> str:
        per_worker = self.plan.resources_per_worker
        text = (
            f"only {fit} worker{'' if fit == 1 else 's'} of {per_worker} fit, "
            f"below min_workers ({self.plan.min_workers})"
        )
        if grace:
            return f"{text}, for longer than the {self.plan.min_workers_grace_s:g} s grace period"
        return text

    def _waiting(self, reason: str) -> None:
        if reason != self.waiting_for:
            self.waiting_for = reason
            self._emit(EventKind.WAITING, {"reason": reason})

    def _complete_recovery(self, attempt: Attempt) -> None:
        r = self.recovery
        assert r is not None
        now = self.clock()
        if r.kind not in ("grow", "drain", "shrink") and r.checkpoint_step is not None:
            restored = r.as_event(Restored, attempt.world_size, now)
            self._emit(restored.KIND, restored.data())
        if r.from_world != attempt.world_size:
            why: dict[str, Any] = {"reason": "drain"} if r.kind == "drain" else {}
            if r.decision is not None:  # the scheduler's word: for whom, or into what
                why = {"reason": r.decision.reason, "for_job": r.decision.for_job}
            resized = r.as_event(Resized, attempt.world_size, now, **why)
            self._emit(resized.KIND, resized.data())
        self.recovery = None

    def _set_state(self, target: JobState, reason: str | None = None, **extra: Any) -> None:
        previous, self.state = self.state, check_transition(self.state, target)
        self._emit(
            EventKind.STATE, {"state": target, "previous": previous, "reason": reason, **extra}
        )

    def _emit(
        self,
        kind: EventKind,
        data: dict[str, Any],
        origin: tuple[str, int] | None = None,
        at: float | None = None,
    ) -> None:
        self.events.append(kind, data, origin, at)
