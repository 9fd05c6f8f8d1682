"""The supervisor's side of in-place recovery: one attempt is a torchft lighthouse (in the
supervisor's process, bound to its node's address) and a replica actor per worker slot up
to ``max_workers``. Replicas beyond the free capacity wait in Ray's queue and join when a
node arrives; a lost replica is replaced the same way. The attempt ends when a replica
finishes the job (the end is decided once: the rest are stopped), on a job error, or when
every replica is gone (then the supervisor restarts from the latest checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.util
import logging
import sys
import time
import urllib.parse
from typing import Any

import ray

from elastic.addresses import url_host
from elastic.attempt import AttemptOutcome
from elastic.attempt_runner import AttemptSpec
from elastic.in_place.fence import fence
from elastic.in_place.members import replica_id
from elastic.in_place.replica import HEARTBEAT_TIMEOUT_MS, Replica
from elastic.in_place.watchdog import POLL_S, LossDetector, read_ages

log = logging.getLogger(__name__)

JOIN_TIMEOUT_MS = 1000
QUORUM_TICK_MS = 20
# At the job's end (or a job error), how long the other replicas placed at the start may
# take to end by themselves before they are stopped.
SETTLE_S = 10.0
# After a replica finished the job, how long the final checkpoint's writer may take.
FINAL_WRITE_S = 60.0


_TORCHFT_EXTENSION = "torchft._torchft"


def lighthouse_server_class() -> Any:
    """torchft's ``LighthouseServer``, loaded from torchft's compiled extension without
    running torchft's package ``__init__``, which imports torch: in the supervisor that was
    about 1.4 CPU-seconds of every in-place job's start and about 560 MB of its memory, for a
    server that needs neither (``torchft.coordination`` re-exports it from that extension).
    Where the extension is not where torchft keeps it, the package is imported after all."""
    module = sys.modules.get(_TORCHFT_EXTENSION)
    if module is None:
        package = importlib.util.find_spec("torchft")  # finds the package, does not run it
        locations = package.submodule_search_locations if package else None
        spec = importlib.machinery.PathFinder.find_spec(_TORCHFT_EXTENSION, locations)
        if spec is None or spec.loader is None:
            from torchft.coordination import LighthouseServer

            return LighthouseServer
        module = importlib.util.module_from_spec(spec)
        # Registered first: torchft imported later in this process reuses it (an extension
        # module is initialised once per process).
        sys.modules[_TORCHFT_EXTENSION] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_TORCHFT_EXTENSION]  # no half-initialised module for later imports
            raise
    return module.LighthouseServer


def reachable_url(advertised: str, host: str) -> str:
    """The lighthouse's URL with ``host``, the address it is bound to, for the replicas.
    torchft advertises ``http://<host name>:<port>``, a name other nodes may not resolve, or
    resolve to loopback (a Kubernetes pod's name, Debian's 127.0.1.1)."""
    port = urllib.parse.urlsplit(advertised).port
    if port is None:
        raise ValueError(f"the lighthouse advertised no port: {advertised!r}")
    return f"http://{url_host(host)}:{port}"


class InPlaceRunner:
    def __init__(self, plan: dict[str, Any], config_for: Any) -> None:
        self.plan = plan
        self.config_for = config_for  # AttemptSpec -> the train-loop config
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

    async def _fence(self, index: int) -> None:
        actor = self.actors.get(index)
        if actor is not None:
            await asyncio.to_thread(fence, actor)

    def _lighthouse(self) -> tuple[Any, str]:
        """The attempt's lighthouse, bound to this node's Ray address, and its URL for the
        replicas."""
        host = ray.util.get_node_ip_address()
        server = lighthouse_server_class()(
            bind=f"{url_host(host)}:0",
            min_replicas=1,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
            # A quorum waiting on a lost replica forms at the first tick after the
            # lighthouse forgets it: torchft's default tick (100 ms) would add to the pause.
            quorum_tick_ms=QUORUM_TICK_MS,
        )
        return server, reachable_url(server.address(), host)

    def _place(self, index: int, config: dict[str, Any], lighthouse: str, joiner: bool) -> Any:
        resources = dict(self.plan["resources_per_worker"])
        actor = Replica.options(  # type: ignore[attr-defined]
            num_cpus=resources.pop("CPU", 1),
            num_gpus=resources.pop("GPU", 0),
            resources=resources or None,
            runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
        ).remote()
        self.actors[index] = actor
        timeout_s = float(self.plan["collective_timeout_s"])
        return actor.run.remote(config, index, lighthouse, timeout_s, joiner, self.starting)

    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        self.stopped = asyncio.Event()
        self.grow = asyncio.Event()
        self.trained = set()
        self.starting = spec.world_size
        self.limit = int(self.plan["max_workers"] if spec.replicas is None else spec.replicas)
        lighthouse, address = self._lighthouse()
        config = self.config_for(spec)
        runs: dict[asyncio.Future[Any], int] = {}
        next_index = 0
        for _ in range(max(self.limit, spec.world_size)):
            runs[
                asyncio.ensure_future(
                    self._place(next_index, config, address, next_index >= spec.world_size)
                )
            ] = next_index
            next_index += 1
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
                        self.actors.pop(index, None)
                        if not self.stopped.is_set() and self._short():
                            call = self._place(next_index, config, address, True)
                            runs[asyncio.ensure_future(call)] = next_index
                            next_index += 1
                        continue
                    except ray.exceptions.RayTaskError as e:
                        if index >= spec.world_size and "no healthy peer" in str(e):
                            continue  # a joiner that came too late never trains alone
                        await self._settle(runs)
                        return AttemptOutcome(f"replica {index}: {str(e).splitlines()[-1]}")
                    finally:
                        self.actors.pop(index, None)
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
            lighthouse.shutdown()

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
        while True:
            await asyncio.sleep(POLL_S)
            try:
                ages = await asyncio.to_thread(read_ages, lighthouse)
            except OSError as e:
                log.warning("in-place watch: lighthouse status unreadable: %s", e)
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
        staying = sorted(i for i in self.actors if i not in self.leaving)
        if len(staying) < size:
            self.grow.set()
            return set()
        return self.leave(set(staying[size:]))

    def _kill_all(self) -> None:
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors.clear()

    def stop(self) -> None:
        self.stopped.set()
        self._kill_all()
