"""The supervisor's side of in-place recovery: one attempt is a torchft lighthouse (held on
the head node by elastic/in_place/lighthouse.py) and a replica actor per worker slot up to
``max_workers``. Replicas beyond the free capacity wait in Ray's queue and join when a node
arrives; a lost replica is replaced the same way. The attempt ends when a replica finishes
the job (the end is decided once: the rest are stopped), on a job error, or when every
replica is gone (then the supervisor restarts from the latest checkpoint).

The replicas and the lighthouse outlive the supervisor: they are detached, and named after
the job and the attempt, so that a supervisor re-created after a loss finds them and adopts
the attempt while they train on. Every path that ends an attempt or a job therefore ends its
replicas explicitly (:func:`end_leftovers` where no runner is left to do it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from typing import Any

import ray

from elastic import warm_processes
from elastic.cluster.reservation import Reservation
from elastic.in_place.fence import fence
from elastic.in_place.lighthouse import HOST_NAME, lighthouse_host
from elastic.in_place.manager import HEARTBEAT_TIMEOUT_MS
from elastic.in_place.members import replica_id
from elastic.in_place.replica import Replica
from elastic.in_place.watchdog import POLL_S, LighthouseStatus, LossDetector
from elastic.supervisor.attempt import AttemptOutcome
from elastic.supervisor.runner import AttemptSpec, RunningAttempt, placement
from elastic.train.entrypoint import EntrypointError

log = logging.getLogger(__name__)

# At the job's end (or a job error), how long the other replicas placed at the start may
# take to end by themselves before they are stopped.
SETTLE_S = 10.0
# After a replica finished the job, how long the final checkpoint's writer may take.
FINAL_WRITE_S = 60.0


def _attempt_prefix(supervisor: str, attempt: int | None = None) -> str:
    """The start of the names of the job's replicas (of one attempt, when given)."""
    return f"{supervisor}-a" if attempt is None else f"{supervisor}-a{attempt}-r"


def _named_replicas(supervisor: str, namespace: str, attempt: int | None = None) -> list[str]:
    prefix = _attempt_prefix(supervisor, attempt)
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(prefix)
    ]


def end_leftovers(supervisor: str, namespace: str, keep_attempt: int | None = None) -> None:
    """End every replica of the job whose supervisor is ``supervisor`` (but attempt
    ``keep_attempt``'s) and its lighthouse: a job that ended, or restarts, without the
    supervisor that started them must leave nothing training."""
    keep = None if keep_attempt is None else _attempt_prefix(supervisor, keep_attempt)
    try:
        names = _named_replicas(supervisor, namespace)
    except Exception as e:  # the GCS busy or restarting: the next call ends them
        log.warning("listing %s's replicas failed: %s", supervisor, e)
        names = []
    for name in names:
        if keep is not None and name.startswith(keep):
            continue
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    if keep_attempt is None:
        with contextlib.suppress(Exception):
            ray.get(ray.get_actor(HOST_NAME, namespace=namespace).close.remote(supervisor))


class InPlaceRunner:
    def __init__(self, plan: dict[str, Any], config_for: Any) -> None:
        self.plan = plan
        self.config_for = config_for  # AttemptSpec -> the train-loop config
        self.name = str(plan["actor_name"])
        self.namespace = str(plan["namespace"])
        self.actors: dict[int, Any] = {}
        # Replicas told to leave a draining node: not a loss when their heartbeats stop.
        self.leaving: set[int] = set()
        # Replicas that have committed a step: the survivors a fast fence protects.
        self.trained: set[int] = set()
        self.starting = 1  # replicas placed at the attempt's start (they start together)
        self.stopped = asyncio.Event()
        # How many replicas the attempt keeps placed (the scheduler's size for the job; else
        # max_workers), and the call that places one more joiner (set while it runs).
        self.limit = int(plan["max_workers"])
        self.grow: asyncio.Event = asyncio.Event()
        self.attempt = 0
        self.host: Any = None
        # The replicas and lighthouse of an attempt that find_running found.
        self.found: dict[int, Any] = {}
        self._lighthouse_url = ""

    async def _fence(self, index: int) -> None:
        actor = self.actors.get(index)
        if actor is not None:
            await asyncio.to_thread(fence, actor)

    def _place(self, index: int, config: dict[str, Any], lighthouse: str, joiner: bool) -> Any:
        """Place replica ``index``; returns the call that says how its run ended."""
        actor = Replica.options(  # type: ignore[attr-defined]
            name=f"{_attempt_prefix(self.name, self.attempt)}{index}",
            namespace=self.namespace,
            lifetime="detached",
            **placement(self.plan["resources_per_worker"]),
            runtime_env=(
                warm_processes.TRAINING_ENV  # a node's ready process
                if self.plan["ready_processes"]
                else warm_processes.PLAIN_REPLICA_ENV
            ),
        ).remote()
        self.actors[index] = actor
        timeout_s = float(self.plan["collective_timeout_s"])
        actor.run.remote(config, index, lighthouse, timeout_s, joiner, self.starting)
        return actor.result.remote()

    def _begin(self, attempt: int, starting: int, limit: int) -> None:
        self.stopped = asyncio.Event()
        self.grow = asyncio.Event()
        self.trained = set()
        self.leaving = set()
        self.attempt = attempt
        self.starting = starting
        self.limit = limit

    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        limit = int(self.plan["max_workers"] if spec.replicas is None else spec.replicas)
        self._begin(spec.attempt, spec.world_size, limit)
        # Nothing of an attempt before this one trains beside it (one a lost supervisor left).
        await asyncio.to_thread(end_leftovers, self.name, self.namespace, spec.attempt)
        self.host = lighthouse_host(self.namespace)
        lighthouse = await self.host.open.remote(
            self.name, spec.attempt, spec.world_size, limit, HEARTBEAT_TIMEOUT_MS
        )
        config = self.config_for(spec)
        runs: dict[asyncio.Future[Any], int] = {}
        for index in range(max(self.limit, spec.world_size)):
            runs[
                asyncio.ensure_future(
                    self._place(index, config, lighthouse.url, index >= spec.world_size)
                )
            ] = index
        return await self._supervise(spec, runs, config, lighthouse.url)

    async def find_running(self) -> RunningAttempt | None:
        try:
            return await self._find_running()
        except Exception:
            # Not found, then: a new attempt shuts the job's lighthouse (the host keeps one
            # per job), so a replica left running loses its quorum and ends.
            log.exception("in place: looking for the attempt a lost supervisor left failed")
            await asyncio.to_thread(end_leftovers, self.name, self.namespace)
            return None

    async def _find_running(self) -> RunningAttempt | None:
        try:
            self.host = await asyncio.to_thread(ray.get_actor, HOST_NAME, namespace=self.namespace)
            lighthouse = await self.host.find.remote(self.name)
        except ValueError:  # no lighthouse host: no in-place attempt ever ran here
            lighthouse = None
        if lighthouse is not None:
            names = await asyncio.to_thread(
                _named_replicas, self.name, self.namespace, lighthouse.attempt
            )
            prefix = _attempt_prefix(self.name, lighthouse.attempt)
            found = {}
            for name in names:
                with contextlib.suppress(ValueError):
                    found[int(name[len(prefix) :])] = ray.get_actor(name, namespace=self.namespace)
            if found:
                self.found = found
                self._begin(lighthouse.attempt, lighthouse.starting, lighthouse.limit)
                self._lighthouse_url = lighthouse.url
                return RunningAttempt(lighthouse.attempt, len(found), lighthouse.limit)
        await asyncio.to_thread(end_leftovers, self.name, self.namespace)
        return None

    async def adopt(self, running: RunningAttempt) -> AttemptOutcome:
        spec = AttemptSpec(running.number, running.world_size, None, frozenset(), running.replicas)
        self.actors = dict(self.found)
        self.found = {}
        runs = {
            asyncio.ensure_future(actor.result.remote()): index
            for index, actor in self.actors.items()
        }
        log.info("in place: adopted attempt %s's replicas %s", running.number, sorted(self.actors))
        return await self._supervise(spec, runs, self.config_for(spec), self._lighthouse_url)

    async def _supervise(
        self,
        spec: AttemptSpec,
        runs: dict[asyncio.Future[Any], int],
        config: dict[str, Any],
        address: str,
    ) -> AttemptOutcome:
        next_index = max(runs.values(), default=-1) + 1
        stop = asyncio.ensure_future(self.stopped.wait())
        watch = asyncio.ensure_future(self._watch(address, config["_elastic"]["supervisor"]))
        finished_at: float | None = None
        try:
            while runs:
                grow = asyncio.ensure_future(self.grow.wait())
                done, _ = await asyncio.wait(
                    {*runs, stop, grow}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                grow.cancel()
                done.discard(grow)
                if stop in done:
                    return AttemptOutcome()
                if self.grow.is_set():  # the scheduler gave the job more workers
                    self.grow.clear()
                    while self._short():
                        call = self._place(next_index, config, address, True)
                        runs[asyncio.ensure_future(call)] = next_index
                        next_index += 1
                if finished_at is not None and time.monotonic() - finished_at > FINAL_WRITE_S:
                    return AttemptOutcome("the final checkpoint's writer did not finish")
                for fut in done:
                    index = runs.pop(fut)
                    try:
                        fut.result()
                    except ray.exceptions.RayActorError:
                        self.leaving.discard(index)
                        # Its node went, or its process died: the others train on; a
                        # replacement waits for capacity in Ray's queue. A worker left behind
                        # by a dead raylet can still hold the survivors' all-reduce: killed.
                        await self._fence(index)
                        self._drop(index)
                        if not self.stopped.is_set() and self._short():
                            call = self._place(next_index, config, address, True)
                            runs[asyncio.ensure_future(call)] = next_index
                            next_index += 1
                        continue
                    except ray.exceptions.RayTaskError as e:
                        if index >= spec.world_size and "no healthy peer" in str(e):
                            continue  # a joiner that came too late never trains alone
                        await self._settle(runs)
                        return AttemptOutcome(
                            f"replica {index}: {str(e).splitlines()[-1]}",
                            code_error=isinstance(getattr(e, "cause", None), EntrypointError),
                        )
                    finally:
                        self._drop(index)
                    if fut.result() == "left":
                        # It left a draining node at a step boundary; its replacement waits
                        # for capacity elsewhere (Ray places nothing on a draining node).
                        self.leaving.discard(index)
                        if not self.stopped.is_set() and self._short():
                            call = self._place(next_index, config, address, True)
                            runs[asyncio.ensure_future(call)] = next_index
                            next_index += 1
                        continue
                    # The job is finished: decided here, once, when the replica that wrote the
                    # final checkpoint says so (the others are stopped then).
                    if fut.result() == "finished":
                        await self._settle(runs)
                        return AttemptOutcome()
                    finished_at = finished_at or time.monotonic()
            if self.limit == 0:  # every replica left at a step, for the scheduler
                return AttemptOutcome()
            return AttemptOutcome("every replica was lost")
        finally:
            stop.cancel()
            watch.cancel()
            self._kill_all()
            for fut in runs:
                fut.cancel()
            self._close_lighthouse()

    async def _settle(self, runs: dict[asyncio.Future[Any], int]) -> None:
        """The job's end is decided: the replicas placed at the start end on their own within
        a step (or fail alike) and their last output reaches the job's log; only then are the
        rest stopped. Replicas still waiting for capacity are not waited for."""
        starters = {fut for fut, index in runs.items() if index < self.starting}
        if starters:
            await asyncio.wait(starters, timeout=SETTLE_S)

    async def _watch(self, lighthouse: str, supervisor: str) -> None:
        """When the lighthouse drops a replica (its heartbeats stopped), the survivors'
        collective with it may never end (a frozen node, a lost node whose process lingers):
        kill its process, so that it never comes back with a stale view and its sockets
        reset, and tell every other replica to discard the step in flight. Ray's own word
        (the actor's death) comes seconds later, and not at all for a frozen process."""
        detector = LossDetector(HEARTBEAT_TIMEOUT_MS / 1000)
        status = LighthouseStatus(lighthouse)
        try:
            await self._watch_ages(status, detector, supervisor)
        finally:
            status.close()

    async def _watch_ages(
        self, status: LighthouseStatus, detector: LossDetector, supervisor: str
    ) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                ages = await asyncio.to_thread(status.ages)
            except OSError as e:
                log.warning("in-place watch: %s", e)
                continue
            ids = {
                replica_id(supervisor, index): index
                for index in self.actors
                if index not in self.leaving
            }
            trained = {replica_id(supervisor, index) for index in self.trained}
            for rid, dropped_for in detector.dropped(ids, ages, trained).items():
                lost = self.actors.get(ids[rid])
                log.warning("in-place: replica %s dropped by the lighthouse; aborting", rid)
                if lost is not None:
                    await self._fence(ids[rid])
                for actor in list(self.actors.values()):
                    if actor is not lost:
                        actor.abort_step.remote(dropped_for)

    def replica_trained(self, index: int) -> None:
        self.trained.add(index)

    def warm_workers(self, exclude: Collection[str] = ()) -> int:
        return 0  # replicas live as long as their attempt

    async def warm_ahead(self, slots: list[Reservation]) -> int:
        raise NotImplementedError("in place, a grow places joiners that heal in, no pause")

    def let_go(self) -> None:
        """Nothing is held between attempts."""

    def close(self) -> None:
        self.stop()

    def leave(self, indices: set[int]) -> set[int]:
        """Replicas ``indices`` are on draining nodes: each leaves the quorum at its next step
        boundary, and the others label the shrink a drain. When none would stay, the quorum's
        rank 0 checkpoints its step first. Returns the replicas told."""
        told = {i for i in indices if i in self.actors and i not in self.leaving}
        if not told:
            return told
        self.leaving |= told
        staying = [a for i, a in self.actors.items() if i not in self.leaving]
        for actor in staying:
            actor.expect_drain.remote()
        for index in told:
            self.actors[index].leave.remote(not staying)
        return told

    def _short(self) -> bool:
        """Fewer replicas placed (or waiting for capacity) than the attempt keeps."""
        return sum(1 for i in self.actors if i not in self.leaving) < self.limit

    def resize(self, size: int) -> set[int]:
        """The scheduler's new size for the job: the replicas beyond it leave the quorum at
        their next step (with a checkpoint of it first when none would stay) and are not
        replaced; below it, joiners are placed. Returns the replicas told to leave."""
        self.limit = size
        if self.host is not None:  # for a supervisor that adopts the attempt
            self.host.set_limit.remote(self.name, self.attempt, size)
        staying = sorted(i for i in self.actors if i not in self.leaving)
        if len(staying) < size:
            self.grow.set()
            return set()
        return self.leave(set(staying[size:]))

    def _drop(self, index: int) -> None:
        """Replica ``index`` is done with (ended, or lost): detached, it is ended by hand."""
        actor = self.actors.pop(index, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def _kill_all(self) -> None:
        for index in list(self.actors):
            self._drop(index)

    def _close_lighthouse(self) -> None:
        if self.host is not None:
            self.host.close.remote(self.name, self.attempt)

    def failure_signalled(self) -> None:
        """Replicas report no loop failure: a failed step is redone by the next quorum."""

    def stop(self) -> None:
        self.stopped.set()
        self._kill_all()
        self._close_lighthouse()
