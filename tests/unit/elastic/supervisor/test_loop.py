"""The supervisor's loop without Ray: a fake capacity source and a fake attempt runner stand
in for the cluster, the test plays the workers, and every run takes milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import pytest

from elastic.checkpoint.directory import CheckpointInfo
from elastic.cluster.capacity import Snapshot
from elastic.cluster.reservation import Reservation
from elastic.cluster.scheduling import Change, Demand, Placement
from elastic.events import EventLog
from elastic.supervisor.attempt import AttemptOutcome
from elastic.supervisor.loop import JobLoop, Timing
from elastic.supervisor.plan import SupervisorPlan
from elastic.supervisor.runner import AttemptSpec, RunningAttempt
from service.store import Store
from service.store.models import JobRow
from tests.clock import Clock
from tests.conftest import small_job

FAST = Timing(
    poll_s=0.01,
    suspect_ttl_s=60,
    release_wait_s=0.02,
    reserve_s=0.01,
    start_s=0.3,
    stop_grace_s=0.1,
)


class FakeCluster:
    """Nodes of one CPU each; a worker of a running fake attempt takes its node's CPU."""

    def __init__(self, nodes: int) -> None:
        self.free = {f"n{i}": 1.0 for i in range(nodes)}
        self.alive = set(self.free)
        self.version = 0
        self.changed = asyncio.Event()
        self.reserved: list[int] = []
        self.draining: dict[str, int] = {}
        # The cluster scheduler's decision for the job (None: the job sizes itself).
        self.target: Placement | None = None

    def bump(self) -> None:
        self.version += 1
        self.changed.set()
        self.changed = asyncio.Event()

    def take(self, node: str) -> None:
        self.free[node] -= 1.0
        self.bump()

    def give(self, node: str) -> None:
        if node in self.alive:
            self.free[node] += 1.0
            self.bump()

    def kill(self, node: str) -> None:
        self.alive.discard(node)
        self.free.pop(node, None)
        self.bump()

    def add(self, node: str) -> None:
        self.alive.add(node)
        self.free[node] = 1.0
        self.bump()

    def free_nodes(self) -> list[str]:
        return sorted(n for n, cpus in self.free.items() if cpus >= 1.0)


class FakeCapacity:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.released: list[tuple[int, bool]] = []
        self.silent: set[str] = set()  # dead, though the membership does not know it yet
        self.registered: list[Demand] = []
        self.unregistered = False
        self.observed: list[tuple[int, float]] = []

    async def snapshot(self, after_version: int = -1, timeout_s: float = 0.0) -> Snapshot:
        c = self.cluster
        if c.version <= after_version and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.changed.wait(), timeout_s)
        free = {n: {"CPU": cpus} for n, cpus in c.free.items()}
        return Snapshot(c.version, frozenset(c.alive), free, dict(c.draining), c.target)

    async def reserve(
        self, workers: int, per_worker: Mapping[str, float], timeout_s: float
    ) -> Reservation | None:
        nodes = self.cluster.free_nodes()
        if len(nodes) < workers:
            return None
        for node in nodes[:workers]:
            self.cluster.take(node)
        return Reservation(workers, nodes[:workers])

    async def release(self, reservation: Reservation, hand_over: bool) -> None:
        self.released.append((reservation.workers, hand_over))
        for node in reservation.handle:
            self.cluster.give(node)

    async def settle(self) -> None:
        pass

    async def unreachable(self, nodes: Collection[str], timeout_s: float) -> set[str]:
        return {n for n in nodes if n not in self.cluster.alive or n in self.silent}

    async def register(self, demand: Demand) -> None:
        self.registered.append(demand)

    async def unregister(self) -> None:
        self.unregistered = True

    async def observe(self, world_size: int, samples_per_s: float) -> None:
        self.observed.append((world_size, samples_per_s))


class FakeRunner:
    """Each attempt's workers take free nodes when it starts; the test finishes it, or the
    loop stops it."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.specs: list[AttemptSpec] = []
        self.nodes: list[str] = []
        self.ending: asyncio.Future[AttemptOutcome] | None = None
        self.stops = 0
        self.signals = 0  # failure signals passed on by the loop
        self.place = True
        self.resized: list[int] = []
        # An attempt a lost supervisor left running, found on the cluster; and those adopted.
        self.left_running: RunningAttempt | None = None
        self.adopted: list[RunningAttempt] = []
        self.trained: list[int] = []  # replicas the loop said have committed a step
        # A grow's new workers, on the nodes reserved for them: ready (warm, held between
        # attempts) once ``warmed`` is set.
        self.warm: list[str] = []
        self.warming: list[int] = []  # how many each warm_ahead placed
        self.warmed = asyncio.Event()
        self.warmed.set()

    async def find_running(self) -> RunningAttempt | None:
        return self.left_running

    async def adopt(self, running: RunningAttempt) -> AttemptOutcome:
        self.adopted.append(running)
        self.nodes = self.cluster.free_nodes()[: running.world_size]
        return await self._until_ended()

    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        """Warm workers first, then free nodes."""
        self.specs.append(spec)
        warm, self.warm = self.warm, []
        for node in warm:
            self.cluster.give(node)
        free = self.cluster.free_nodes()
        nodes = [n for n in warm if n in free] + [n for n in free if n not in warm]
        self.nodes = nodes[: spec.world_size] if self.place else []
        return await self._until_ended()

    async def warm_ahead(self, slots: list[Reservation]) -> int:
        nodes = [node for slot in slots for node in slot.handle]
        self.warming.append(len(nodes))
        await self.warmed.wait()
        self.warm += nodes
        return len(nodes)

    async def _until_ended(self) -> AttemptOutcome:
        for node in self.nodes:
            self.cluster.take(node)
        self.ending = asyncio.get_running_loop().create_future()
        try:
            return await self.ending
        finally:
            for node in self.nodes:
                self.cluster.give(node)
            self.nodes = []

    def stop(self) -> None:
        self.stops += 1
        self.end(AttemptOutcome())

    def failure_signalled(self) -> None:
        self.signals += 1

    def resize(self, size: int) -> set[int]:
        self.resized.append(size)
        return set()

    def leave(self, ranks: set[int]) -> set[int]:
        return set()

    def replica_trained(self, index: int) -> None:
        self.trained.append(index)

    def warm_workers(self, exclude: Collection[str] = ()) -> int:
        return sum(1 for node in self.warm if node not in exclude)

    def let_go(self) -> None:
        warm, self.warm = self.warm, []
        for node in warm:
            self.cluster.give(node)

    def close(self) -> None:
        self.stop()
        self.let_go()

    def end(self, outcome: AttemptOutcome) -> None:
        if self.ending is not None and not self.ending.done():
            self.ending.set_result(outcome)


class FakeCheckpoints:
    def __init__(self) -> None:
        self.valid: list[int] = []
        self.corrupt: list[int] = []

    def latest_valid(self) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]:
        skipped = [
            (CheckpointInfo(s, f"/c/step_{s}", 1, 0.0), "fails its checksum")
            for s in sorted(self.corrupt, reverse=True)
            if not self.valid or s > max(self.valid)
        ]
        if not self.valid:
            return None, skipped
        step = max(self.valid)
        return CheckpointInfo(step, f"/c/step_{step}", 1, 0.0), skipped


def make_plan(**overrides: Any) -> SupervisorPlan:
    fields: dict[str, Any] = {
        "job_id": "job",
        "train_loop": "m:f",
        "train_config": {},
        "min_workers": 1,
        "max_workers": 3,
        "resources_per_worker": {"CPU": 1.0},
        "backend": "gloo",
        "checkpoint_dir": "/c",
        "every_steps": 10,
        "keep": 3,
        "max_restarts": 1,
        "min_workers_grace_s": 0.2,
        "actor_name": "sup",
        "namespace": "ns",
        "fault_tolerance": "restart",
    }
    return SupervisorPlan(**(fields | overrides))


class Harness:
    def __init__(
        self,
        cluster: FakeCluster,
        storage_check: Callable[[], Awaitable[str | None]] | None = None,
        timing: Timing = FAST,
        **plan: Any,
    ) -> None:
        self.cluster = cluster
        self.clock = Clock(1000.0)
        self.runner = FakeRunner(cluster)
        self.capacity = FakeCapacity(cluster)
        self.checkpoints = FakeCheckpoints()
        self.log = EventLog(1, clock=self.clock)
        self.loop = JobLoop(
            make_plan(**plan),
            self.runner,
            self.capacity,
            self.checkpoints,
            self.log,
            timing,
            self.clock,
            storage_check,
        )
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.loop.run())

    async def until(self, test: Callable[[], bool], what: str, timeout: float = 2.0) -> None:
        async def wait() -> None:
            while not test():
                await asyncio.sleep(0.002)

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; events: {self.kinds()}") from None

    async def attempt(self, number: int) -> AttemptSpec:
        await self.until(lambda: len(self.runner.specs) >= number, f"attempt {number}")
        return self.runner.specs[number - 1]

    async def workers_start(self, number: int, step: int, **first: Any) -> None:
        """The attempt's workers register and report their first step (``first``: more
        fields of that report)."""
        spec = await self.attempt(number)
        await self.until(lambda: self.loop.attempt is not None, "the attempt")
        for rank, node in enumerate(self.runner.nodes):
            self.loop.register_worker(spec.attempt, rank, node)
        self.metrics(spec.attempt, step, **first)

    def metrics(self, attempt: int, step: int, **extra: Any) -> None:
        self.loop.record("metrics", {"attempt": attempt, "step": step, "world_size": 0} | extra)

    def saved(self, attempt: int, step: int) -> None:
        self.checkpoints.valid.append(step)
        self.loop.record("checkpoint_saved", {"attempt": attempt, "step": step, "path": "p"})

    async def finish(self) -> None:
        assert self.task is not None
        await asyncio.wait_for(self.task, 3)

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.log.pending]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e["data"] for e in self.log.pending if e["kind"] == kind]

    def states(self) -> list[str]:
        return [d["state"] for d in self.of("state")]


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_lost_node_shrinks_the_job_and_the_recovery_counts_from_the_first_signal() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(3))
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0] == AttemptSpec(1, 3, None)
        h.saved(1, 10)
        h.metrics(1, 13, completed_step=14)
        lost = h.runner.nodes[1]
        # The worker saw its collective fail 2 s before the membership caught up.
        h.loop.record("failure_signal", {"attempt": 1, "rank": 0, "time": 998.0})
        assert h.runner.signals == 1  # the runner counts the attempt failed from here
        h.cluster.kill(lost)
        await h.attempt(2)
        assert h.runner.specs[1] == AttemptSpec(2, 2, "/c/step_10")
        h.clock.now = 1007.5
        await h.workers_start(2, step=11)

        assert h.states() == ["starting", "running", "recovering", "running"]
        (worker_lost,) = h.of("worker_lost")
        assert worker_lost["nodes"] == [lost] and worker_lost["ranks"] == [1]
        assert worker_lost["reason"] == f"node {lost} left the cluster"
        (resized,) = h.of("resized")
        assert resized == {
            "kind": "resized",
            "from_world": 3,
            "to_world": 2,
            "checkpoint_step": 10,
            "steps_redone": 4,  # the last completed step (14), not the last reported (13)
            "detection_seconds": 2.0,
            "recovery_seconds": 9.5,
            "attempts": 1,
            # Every field of a WorldChange, in both modes: in place's own (pause, step) are
            # None here, and a resize for a loss names no node, rank or reason.
            "pause_seconds": None,
            "step": None,
            "in_place": False,
            "nodes": [],
            "ranks": [],
            "replicas": [],
            "reason": None,
            "for_job": None,
        }
        assert h.of("restored") == [resized | {"kind": "restored"}]
        assert h.loop.cancel("done") == "cancelled"
        await h.finish()

    run(body)


def test_a_job_grows_only_once_its_new_worker_is_placed_and_ready() -> None:
    """The capacity is reserved, handed to a new worker at once, and the others train on
    while it warms up: the pause comes at the first checkpoint after it is ready."""

    async def body() -> None:
        cluster = FakeCluster(2)
        h = Harness(cluster)
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0].world_size == 2
        assert not h.loop.should_pause(1, 10)  # nothing free: no reason to pause
        h.runner.warmed.clear()
        cluster.add("n9")
        await h.until(lambda: h.runner.warming == [1], "the new worker placed")
        assert cluster.free["n9"] == 0.0  # its slot is the job's, before any pause
        h.saved(1, 10)
        assert not h.loop.should_pause(1, 10)  # still warming: the others train on
        assert h.of("scheduled") == []
        h.runner.warmed.set()
        attempt = h.loop.attempt
        assert attempt is not None
        await h.until(lambda: attempt.grow_to == 3, "the grow, once the worker is ready")
        assert h.loop.reservation is None and h.loop.runner.warm_workers() == 1
        h.saved(1, 20)
        assert h.loop.should_pause(1, 20)
        h.runner.end(AttemptOutcome())  # the workers stop at the checkpoint
        await h.attempt(2)
        assert h.runner.specs[1] == AttemptSpec(2, 3, "/c/step_20")
        # The start's reservation was handed to its attempt; the grow's is its new worker's.
        assert h.capacity.released == [(2, True)]
        await h.workers_start(2, step=21)
        (grow,) = h.of("resized")
        assert (grow["from_world"], grow["to_world"], grow["steps_redone"]) == (2, 3, 0)
        assert h.of("restored") == []
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["starting", "running", "succeeded"]

    run(body)


def test_two_jobs_racing_for_one_free_slot_only_one_pauses() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        cluster.take("n1")
        cluster.take("n2")
        a = Harness(cluster, max_workers=2)
        b = Harness(cluster, max_workers=2)
        a.start()
        await a.attempt(1)  # on n0
        b.start()
        cluster.give("n1")
        await b.attempt(1)  # on n1
        assert [h.runner.specs[0].world_size for h in (a, b)] == [1, 1]
        cluster.give("n2")  # one free slot, and both jobs would grow into it
        await a.workers_start(1, step=1)
        await b.workers_start(1, step=1)

        def grows(h: Harness) -> bool:
            return h.loop.attempt is not None and h.loop.attempt.grow_to is not None

        await a.until(lambda: any(grows(h) for h in (a, b)), "one grow")
        await asyncio.sleep(0.05)  # the loser's attempt to reserve has come and gone
        held = [grows(h) for h in (a, b)]
        assert sorted(held) == [False, True]
        assert sorted(h.runner.warming for h in (a, b)) == [[], [1]]
        assert [h.loop.should_pause(1, 10) for h in (a, b)] == held
        for h in (a, b):
            h.loop.cancel("done")
            await h.finish()
        assert cluster.free["n2"] == 1.0  # the cancelled job's new worker gave its slot back

    run(body)


def test_errors_give_up_after_max_restarts_but_a_checkpoint_resets_the_count() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(1), max_restarts=1)
        h.start()
        for attempt in (1, 2, 3):
            await h.workers_start(attempt, step=attempt * 10 - 9)
            h.saved(attempt, attempt * 10)  # progress: the count starts again
            h.runner.end(AttemptOutcome("rank 0: ValueError: boom"))
        await h.workers_start(4, step=31)
        h.runner.end(AttemptOutcome("rank 0: ValueError: boom"))  # 1st in a row: retried
        await h.workers_start(5, step=31)
        h.runner.end(AttemptOutcome("rank 0: ValueError: boom"))  # 2nd in a row: gives up
        await h.finish()
        assert h.loop.state == "failed"
        assert h.of("state")[-1]["reason"] == (
            "rank 0: ValueError: boom (gave up after 1 restart; max_restarts is 1)"
        )
        assert len(h.runner.specs) == 5

    run(body)


def test_node_losses_are_not_job_errors() -> None:
    async def body() -> None:
        cluster = FakeCluster(2)
        h = Harness(cluster, max_restarts=0, min_workers_grace_s=5)
        h.start()
        for attempt in range(1, 5):
            await h.workers_start(attempt, step=1)
            cluster.kill(h.runner.nodes[0])
            cluster.add(f"new{attempt}")
        await h.workers_start(5, step=1)
        assert h.loop.state == "running"
        assert len(h.of("worker_lost")) == 4
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_a_recovery_over_several_attempts_reports_the_whole_span() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(2), max_restarts=3)
        h.start()
        await h.workers_start(1, step=1)
        h.saved(1, 10)
        h.metrics(1, 12)
        h.runner.end(AttemptOutcome("rank 1: RuntimeError: gloo"))
        await h.attempt(2)
        h.clock.now += 4
        h.runner.end(AttemptOutcome("rank 0: RuntimeError: again"))  # before its first step
        await h.attempt(3)
        h.clock.now += 3
        await h.workers_start(3, step=11)
        (restored,) = h.of("restored")
        assert restored["attempts"] == 2 and restored["recovery_seconds"] == 7.0
        assert restored["steps_redone"] == 2
        assert h.states() == ["starting", "running", "recovering", "running"]
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_cancel_mid_attempt_ends_the_attempt() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(2))
        h.start()
        await h.workers_start(1, step=1)
        assert h.loop.cancel("cancelled by the user") == "cancelled"
        await h.finish()
        assert h.runner.stops >= 1 and len(h.runner.specs) == 1
        assert h.states() == ["starting", "running", "cancelled"]
        h.metrics(1, 2)  # late news is dropped
        assert h.kinds()[-1] == "state"

    run(body)


def test_a_recreated_supervisor_resumes_from_the_latest_checkpoint() -> None:
    async def body() -> None:
        h = Harness(
            FakeCluster(2),
            initial_state="running",
            recreated=True,
            last_step=27,
            last_world_size=3,
            first_attempt=40,
        )
        h.checkpoints.valid = [10, 20]
        h.start()
        await h.workers_start(1, step=21)
        assert h.runner.specs[0] == AttemptSpec(40, 2, "/c/step_20")
        (note,) = h.of("supervisor_recreated")
        assert note == {"previous_state": "running", "checkpoint_step": 20}
        assert h.states() == ["recovering", "running"]
        assert h.of("state")[0]["reason"] == (
            "the job's supervisor was lost; a new one resumes it from the checkpoint of step 20"
        )
        (restored,) = h.of("restored")
        assert (restored["from_world"], restored["to_world"], restored["steps_redone"]) == (3, 2, 7)
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_a_recreated_supervisor_adopts_the_attempt_its_predecessor_left_running() -> None:
    """In place, the replicas outlived the lost supervisor: the new one watches their attempt
    under its number, with no restart, no recovery and no state change; their news resent to
    it is taken once, from past what the service had stored, at the time it was sent."""

    async def body() -> None:
        h = Harness(
            FakeCluster(3),
            initial_state="running",
            recreated=True,
            last_step=27,
            last_world_size=3,
            first_attempt=40,
            fault_tolerance="in_place",
            delivered={"replica-0": 5},
        )
        h.checkpoints.valid = [10, 20]
        h.runner.left_running = RunningAttempt(39, 3, 3)

        def news(n: int) -> None:
            data = {"attempt": 39, "step": 24 + n, "world_size": 3}
            h.loop.record("metrics", data, "replica-0", n, 900.0 + n)  # sent at 900 + n

        # Sent before the supervisor knew it would adopt the attempt: held until it does.
        news(6)
        h.loop.register_worker(39, 0, "node-0")
        h.start()
        await h.until(lambda: bool(h.runner.adopted), "the adoption")
        assert h.runner.adopted == [RunningAttempt(39, 3, 3)] and h.runner.specs == []
        assert h.of("supervisor_recreated") == [
            {"previous_state": "running", "adopted_attempt": 39}
        ]
        assert h.loop.status()["worker_nodes"] == {0: "node-0"}
        for n in (4, 5, 7):  # 4 and 5 were stored from the lost supervisor
            news(n)
        assert [d["step"] for d in h.of("metrics")] == [30, 31]
        shown = [(e["origin"], e["time"]) for e in h.log.pending if e["kind"] == "metrics"]
        assert shown == [(["replica-0", 6], 906.0), (["replica-0", 7], 907.0)]
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["succeeded"] and h.loop.status()["step"] == 31
        assert not {"attempt_started", "restored", "worker_lost"} & set(h.kinds())

    run(body)


def test_when_every_checkpoint_is_corrupt_the_job_fails_instead_of_starting_over() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(1), max_restarts=3)
        h.start()
        await h.workers_start(1, step=1)
        h.saved(1, 10)
        h.checkpoints.valid.clear()
        h.checkpoints.corrupt = [10]
        h.runner.end(AttemptOutcome("rank 0: RuntimeError: gloo"))
        await h.finish()
        assert h.of("checkpoint_corrupt") == [
            {"step": 10, "path": "/c/step_10", "reason": "fails its checksum"}
        ]
        assert h.loop.state == "failed" and len(h.runner.specs) == 1
        assert h.of("state")[-1]["reason"] == (
            "no valid checkpoint is left (steps 10 fail verification); "
            "the job does not start over from step 0"
        )

    run(body)


def test_workers_that_never_start_send_a_starting_job_back_to_queued_then_fail() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(2))
        h.runner.place = False  # another job's workers took the slots: none is placed
        h.start()
        await h.until(lambda: len(h.runner.specs) == 4 or h.loop.state == "failed", "the end")
        await h.finish()
        assert h.states() == [
            "starting",
            "queued",
            "starting",
            "queued",
            "starting",
            "queued",
            "starting",
            "failed",
        ]
        reason = "only 0 of 2 workers started within 0.3 s"
        assert h.of("state")[1]["reason"] == reason
        assert h.of("state")[-1]["reason"] == (
            f"{reason} (gave up after 3 worker groups in a row could not start; the limit is 3)"
        )

    run(body)


def test_a_queued_job_that_loses_the_race_for_capacity_stays_queued_and_says_why() -> None:
    async def body() -> None:
        cluster = FakeCluster(1)
        h = Harness(cluster)
        real_reserve = h.capacity.reserve
        lost_once: list[bool] = []

        async def reserve_after_a_rival(*args: Any) -> Reservation | None:
            if not lost_once:  # a rival's reservation lands first
                lost_once.append(True)
                return None
            return await real_reserve(*args)

        h.capacity.reserve = reserve_after_a_rival  # type: ignore[method-assign]
        h.start()
        await h.workers_start(1, step=1)
        assert h.of("waiting") == [{"reason": "1 free worker slots went to another job; waiting"}]
        assert h.states() == ["starting", "running"]
        h.loop.cancel("done")
        await h.finish()

    run(body)


@pytest.mark.parametrize("pending", [3])
def test_the_event_log_is_bounded_and_says_what_it_dropped(pending: int) -> None:
    from elastic.events import EventKind

    log = EventLog(1, max_pending=pending)
    for i in range(5):
        log.append(EventKind.LOG, {"i": i})
    log.append(EventKind.STATE, {"state": "running"})  # the story is always kept
    assert [e["kind"] for e in log.pending] == ["log", "log", "log", "state"]
    log.ack(3)
    log.append(EventKind.METRICS, {"step": 1})
    assert [(e["seq"], e["kind"]) for e in log.pending] == [
        (4, "state"),
        (5, "events_dropped"),
        (6, "metrics"),
    ]
    assert log.pending[1]["data"] == {"log": 2}


def test_a_failure_from_a_node_the_membership_still_shows_alive_is_a_node_loss() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        h = Harness(cluster, max_restarts=0)
        h.start()
        await h.workers_start(1, step=1)
        dead = h.runner.nodes[2]
        h.capacity.silent.add(dead)  # killed a moment ago: Ray has not noticed yet
        h.runner.end(AttemptOutcome("rank 0: RuntimeError: Connection closed by peer"))
        await h.attempt(2)
        (lost,) = h.of("worker_lost")
        assert lost["nodes"] == [dead] and lost["ranks"] == [2]
        assert h.runner.specs[1].world_size == 2  # the silent node is left out of sizing
        assert h.loop.state == "recovering"  # max_restarts=0, and still it goes on
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_attempts_that_fail_while_recovering_are_restarts_within_the_limit() -> None:
    """Issue 13 #10: a second failure while the job is already recovering is one more
    restart (no illegal recovering -> recovering), and the last one gives the real reason."""

    async def body() -> None:
        h = Harness(FakeCluster(1), max_restarts=2)
        h.start()
        await h.workers_start(1, step=1)
        h.runner.end(AttemptOutcome("rank 0: OSError: disk gone"))
        for number in (2, 3):  # never reaches a step: the job stays recovering
            await h.attempt(number)
            assert h.loop.state == "recovering"
            h.runner.end(AttemptOutcome("rank 0: OSError: disk gone"))
        await h.finish()
        states = [e["state"] for e in h.of("state")]
        assert states == ["starting", "running", "recovering", "failed"]
        assert h.of("state")[-1]["reason"] == (
            "rank 0: OSError: disk gone (gave up after 2 restarts; max_restarts is 2)"
        )
        assert len(h.runner.specs) == 3

    run(body)


def stored(store: Store, h: Harness) -> JobRow:
    """The job as the service keeps it, once it has stored what the supervisor said (the
    supervisor numbers its events after the service's own first one)."""
    job = store.create_job("demo", "admin", "image-classification", small_job())
    store.append_events(job.id, [{**e, "seq": e["seq"] + 1} for e in h.log.pending])
    row = store.get_job(job.id)
    assert row is not None
    return row


def test_the_restarts_the_service_shows_are_those_the_supervisor_gave_up_after(
    store: Store,
) -> None:
    """`etrain status` said `restarts 1` of a job that "gave up after 3 restarts": attempts
    that fail before their first step leave the job recovering, with no state event."""

    async def body() -> Harness:
        h = Harness(FakeCluster(1), max_restarts=3)
        h.start()
        for number in (1, 2, 3, 4):
            await h.attempt(number)
            h.runner.end(AttemptOutcome("rank 0: FileNotFoundError: nope"))
        await h.finish()
        return h

    h = asyncio.run(asyncio.wait_for(body(), 10))
    assert h.states() == ["starting", "recovering", "failed"]
    row = stored(store, h)
    assert (row.state, row.restarts) == ("failed", 3)
    assert row.message == (
        "rank 0: FileNotFoundError: nope (gave up after 3 restarts; max_restarts is 3)"
    )


def test_a_restart_the_scheduler_held_back_in_the_queue_is_counted_once(store: Store) -> None:
    async def body() -> Harness:
        cluster = FakeCluster(1)
        decide(cluster, 1, Change.START, "started")
        h = Harness(cluster, max_restarts=3)
        h.start()
        await h.workers_start(1, step=1)
        decide(cluster, 0, Change.WAIT, "waiting behind 1 job of priority 100")
        h.runner.end(AttemptOutcome("rank 0: OSError: disk gone"))
        await h.until(lambda: h.loop.state == "queued", "held back in the queue")
        decide(cluster, 1, Change.START, "started")
        await h.workers_start(2, step=1)
        h.runner.end(AttemptOutcome())
        await h.finish()
        return h

    h = asyncio.run(asyncio.wait_for(body(), 10))
    assert h.states() == [
        "starting",
        "running",
        "recovering",
        "queued",
        "starting",
        "running",
        "succeeded",
    ]
    row = stored(store, h)
    assert (row.state, row.restarts) == ("succeeded", 1)


def test_a_checkpoint_location_the_nodes_do_not_share_fails_the_job_before_any_attempt() -> None:
    async def problem() -> str | None:
        return "the checkpoint directory /c is not shared by every Ray node"

    async def body() -> None:
        h = Harness(FakeCluster(2), storage_check=problem)
        h.start()
        await h.finish()
        assert h.loop.state == "failed" and h.runner.specs == []
        assert h.of("state") == [
            {
                "state": "failed",
                "previous": "queued",
                "reason": "the checkpoint directory /c is not shared by every Ray node",
            }
        ]

    run(body)


def test_a_shared_checkpoint_location_lets_the_job_start() -> None:
    async def fine() -> str | None:
        return None

    async def body() -> None:
        h = Harness(FakeCluster(1), storage_check=fine)
        h.start()
        await h.workers_start(1, step=1)
        assert h.loop.state == "running"
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_a_recreated_supervisor_without_a_checkpoint_says_it_starts_from_step_0() -> None:
    async def body() -> None:
        h = Harness(
            FakeCluster(1), initial_state="running", recreated=True, last_step=7, first_attempt=3
        )
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0] == AttemptSpec(3, 1, None)
        assert h.of("supervisor_recreated") == [
            {"previous_state": "running", "checkpoint_step": None}
        ]
        assert h.of("state")[0]["reason"] == (
            "the job's supervisor was lost; a new one resumes it from step 0 "
            "(no checkpoint was saved; step 7 was reached)"
        )
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_a_drained_node_pauses_the_job_at_its_next_step_and_it_resizes_off_it() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        h = Harness(cluster)
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0].world_size == 3
        assert not h.loop.should_pause(1, 10)  # nothing drains yet
        assert not h.loop.drain_pending(1)
        h.saved(1, 10)
        drained = h.runner.nodes[2]
        cluster.draining[drained] = 2_000_000  # a preemption notice with a deadline
        cluster.bump()
        await h.until(lambda: h.loop.draining is not None, "the drain noticed")
        # Rank 0 asks at every step; an old attempt's rank 0 is told nothing.
        assert h.loop.drain_pending(1) and not h.loop.drain_pending(0)
        h.metrics(1, 17, completed_step=17)
        h.saved(1, 18)  # the first step after the answer, off the checkpoint schedule
        assert h.loop.should_pause(1, 18)
        h.runner.end(AttemptOutcome())  # the workers stop there
        await h.attempt(2)
        # The draining node is alive and its CPU free again, but the job leaves it.
        assert h.runner.specs[1] == AttemptSpec(2, 2, "/c/step_18", frozenset({drained}))
        assert drained not in h.runner.nodes
        assert not h.loop.drain_pending(2)
        await h.workers_start(2, step=19)
        (resized,) = h.of("resized")
        assert (resized["from_world"], resized["to_world"], resized["steps_redone"]) == (3, 2, 0)
        assert resized["reason"] == "drain"
        assert h.of("restored") == [] and h.of("worker_lost") == []
        assert not h.loop.should_pause(2, 30)  # the drain was for the attempt before
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["starting", "running", "succeeded"]

    run(body)


def test_a_drained_node_that_goes_once_its_workers_paused_is_no_loss() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        h = Harness(cluster)
        h.start()
        await h.workers_start(1, step=1)
        drained = h.runner.nodes[2]
        cluster.draining[drained] = 2_000_000
        cluster.bump()
        await h.until(lambda: h.loop.draining is not None, "the drain noticed")
        h.saved(1, 15)
        assert h.loop.should_pause(1, 15)
        # Ray ends a drained node as soon as it is idle: here before the worker group's end
        # reaches the supervisor, which then reports the group's failure on the way out.
        cluster.kill(drained)
        await asyncio.sleep(0.05)  # polls of the membership, which now lacks the node
        assert h.runner.stops == 0
        h.runner.end(AttemptOutcome(error="a worker died", dead_ranks=[2]))
        assert await h.attempt(2) == AttemptSpec(2, 2, "/c/step_15")
        await h.workers_start(2, step=16)
        (resized,) = h.of("resized")
        assert (resized["from_world"], resized["to_world"], resized["steps_redone"]) == (3, 2, 0)
        assert resized["reason"] == "drain"
        assert h.of("worker_lost") == [] and h.of("restored") == []
        assert h.states() == ["starting", "running"]
        h.loop.cancel("done")
        await h.finish()

    run(body)


# -- the cluster scheduler's orders ---------------------------------------------------------


def decide(cluster: FakeCluster, size: int, change: Change, reason: str, **kw: Any) -> None:
    cluster.target = Placement("job", size, change, reason, **kw)
    cluster.bump()


def test_the_job_registers_its_demand_and_waits_while_the_scheduler_holds_it_back() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        decide(cluster, 0, Change.WAIT, "waiting: 1 job of higher priority ahead")
        h = Harness(cluster, owner="alice", priority=100, submitted_at=5.0)
        h.start()
        await h.until(lambda: h.of("waiting") != [], "the wait")
        (demand,) = h.capacity.registered
        assert (demand.owner, demand.priority, demand.min_workers, demand.max_workers) == (
            "alice",
            100,
            1,
            3,
        )
        assert (demand.submitted_at, demand.resize, dict(demand.per_worker)) == (
            5.0,
            "restart",
            {"CPU": 1.0},
        )
        assert h.of("waiting") == [{"reason": "waiting: 1 job of higher priority ahead"}]
        assert h.runner.specs == []  # three slots are free, and it does not take them
        decide(cluster, 2, Change.START, "started")
        # The first step's rate times a warm-up too: not told as the rate at 2.
        await h.workers_start(1, step=1, samples_per_s=30.0, world_size=2)
        assert h.runner.specs[0].world_size == 2  # the scheduler's size, not what is free
        h.metrics(1, 2, samples_per_s=80.0, world_size=2)
        await h.until(lambda: h.capacity.observed == [(2, 80.0)], "the throughput told")
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.capacity.unregistered

    run(body)


def test_a_start_planned_larger_than_what_is_free_waits_a_moment_for_workers_handed_back() -> None:
    """The scheduler plans a job at 3 while an ended job's worker still holds a node: it
    starts at 3 once Ray has it back, not at 2 (then grown, a restart, seconds later); when
    the worker is not handed back within the release wait, it starts at what is free."""

    async def body() -> None:
        cluster = FakeCluster(3)
        cluster.take("n0")  # the ended job's worker, on its way out
        decide(cluster, 3, Change.START, "started")
        h = Harness(cluster, timing=dataclasses.replace(FAST, release_wait_s=5.0))
        h.start()
        await asyncio.sleep(0.2)
        assert h.runner.specs == []
        assert h.states() == []  # still queued, as it was
        cluster.give("n0")
        assert (await h.attempt(1)).world_size == 3

        cluster = FakeCluster(3)
        cluster.take("n0")  # held for good
        decide(cluster, 3, Change.START, "started")
        h = Harness(cluster, timing=dataclasses.replace(FAST, release_wait_s=0.2))
        h.start()
        assert (await h.attempt(1)).world_size == 2

    run(body)


def test_a_grow_whose_workers_come_back_a_moment_apart_is_one_pause() -> None:
    """The scheduler grows a job from 1 to 3 as another job's two workers go back to Ray
    one by one: it waits a moment for the second and grows once, to 3; when the second is
    not back within the release wait, it grows to what is free."""

    async def grow(second_back: bool, grown_to: int) -> None:
        cluster = FakeCluster(3)
        cluster.take("n1")  # the other job's two workers
        cluster.take("n2")
        decide(cluster, 1, Change.START, "started")
        timing = dataclasses.replace(FAST, release_wait_s=1.0 if second_back else 0.2)
        h = Harness(cluster, timing=timing)
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0].world_size == 1
        decide(cluster, 3, Change.GROW, "grew into idle capacity")
        cluster.give("n1")
        if second_back:
            await asyncio.sleep(0.3)
            assert h.runner.warming == []  # no pause for one worker of the two
            cluster.give("n2")
        await h.until(lambda: h.runner.warming != [], "new workers placed")
        assert h.runner.warming == [grown_to - 1]
        attempt = h.loop.attempt
        assert attempt is not None
        await h.until(lambda: attempt.grow_to is not None, "the grow decided")
        (told,) = h.of("scheduled")
        assert (told["from_world"], told["to_world"]) == (1, grown_to)
        h.saved(1, 10)
        assert h.loop.should_pause(1, 10)
        h.runner.end(AttemptOutcome())
        assert (await h.attempt(2)).world_size == grown_to
        assert h.loop.cancel("done") == "cancelled"
        await h.finish()

    async def body() -> None:
        await grow(True, 3)
        await grow(False, 2)

    run(body)


def test_the_scheduler_shrinks_a_running_job_at_its_next_step_without_redoing_one() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        decide(cluster, 3, Change.START, "started")
        h = Harness(cluster)
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0].world_size == 3
        h.metrics(1, 2, samples_per_s=90.0, world_size=3)
        await h.until(lambda: h.capacity.observed == [(3, 90.0)], "the throughput told")
        decide(cluster, 1, Change.SHRINK, "shrunk for job hi (priority 100)", for_job="hi")
        await h.until(lambda: h.loop.drain_pending(1), "the shrink noticed")
        # The step that pauses waits for its checkpoint: not the job's rate at 3.
        h.metrics(1, 7, samples_per_s=40.0, world_size=3)
        (told,) = h.of("scheduled")
        assert told == {
            "change": "shrink",
            "from_world": 3,
            "to_world": 1,
            "reason": "shrunk for job hi (priority 100)",
            "for_job": "hi",
        }
        h.saved(1, 7)  # rank 0 pauses at its next step, with a checkpoint of it
        assert h.loop.should_pause(1, 7)
        h.runner.end(AttemptOutcome())
        spec = await h.attempt(2)
        assert (spec.world_size, spec.resume_path) == (1, "/c/step_7")
        await h.workers_start(2, step=8)
        (resized,) = h.of("resized")
        assert (resized["from_world"], resized["to_world"], resized["steps_redone"]) == (3, 1, 0)
        assert (resized["reason"], resized["for_job"]) == ("shrunk for job hi (priority 100)", "hi")
        assert h.of("restored") == []
        h.metrics(2, 9, samples_per_s=85.0, world_size=1)
        await h.until(lambda: (1, 85.0) in h.capacity.observed, "the rate at 1 told")
        assert h.capacity.observed == [(3, 90.0), (1, 85.0)]
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["starting", "running", "succeeded"]

    run(body)


def test_a_preempted_job_goes_back_to_the_queue_and_resumes_from_its_pause() -> None:
    async def body() -> None:
        cluster = FakeCluster(2)
        decide(cluster, 2, Change.START, "started")
        h = Harness(cluster, min_workers=2)
        h.start()
        await h.workers_start(1, step=1)
        why = "preempted for job hi (priority 100)"
        decide(cluster, 0, Change.PREEMPT, why, for_job="hi")
        await h.until(lambda: h.loop.drain_pending(1), "the preemption noticed")
        h.saved(1, 4)
        assert h.loop.should_pause(1, 4)
        h.runner.end(AttemptOutcome())
        await h.until(lambda: h.loop.state == "queued", "back in the queue")
        assert h.of("state")[-1]["reason"] == why
        await asyncio.sleep(0.05)
        assert len(h.runner.specs) == 1  # it waits: the two free slots are not its own
        decide(cluster, 2, Change.START, "started")
        spec = await h.attempt(2)
        assert (spec.world_size, spec.resume_path) == (2, "/c/step_4")
        await h.workers_start(2, step=5)
        assert [d["checkpoint_step"] for d in h.of("restored")] == [4]
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["starting", "running", "queued", "starting", "running", "succeeded"]

    run(body)


def test_in_place_the_scheduler_resizes_the_running_replicas() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        decide(cluster, 2, Change.START, "started")
        h = Harness(cluster, fault_tolerance="in_place")
        h.start()
        await h.workers_start(1, step=1)
        assert h.runner.specs[0].replicas == 2
        decide(cluster, 3, Change.GROW, "grew into idle capacity")
        await h.until(lambda: h.runner.resized == [3], "the grow told")
        decide(cluster, 1, Change.SHRINK, "shrunk for job hi (priority 100)", for_job="hi")
        await h.until(lambda: h.runner.resized == [3, 1], "the shrink told")
        assert [(d["change"], d["from_world"], d["to_world"]) for d in h.of("scheduled")] == [
            ("grow", 2, 3),
            ("shrink", 3, 1),
        ]
        assert len(h.runner.specs) == 1  # no restart
        h.runner.end(AttemptOutcome())
        await h.finish()

    run(body)


def test_a_step_reported_again_by_a_new_reporter_is_logged_once() -> None:
    """In place, a replica that becomes the quorum's reporter sends the last report again
    (the reporter before it may have died with it in flight): a step already logged is
    dropped, one that was lost is logged, and a new attempt starts with none seen."""

    async def body() -> None:
        h = Harness(FakeCluster(3))
        h.start()
        await h.workers_start(1, step=1)

        def report(sender: str, n: int, step: int) -> None:
            data = {"attempt": 1, "step": step, "world_size": 3}
            h.loop.record("metrics", data, sender=sender, n=n)

        report("replica-0", 0, 2)
        report("replica-0", 1, 3)
        report("replica-1", 0, 3)  # replica 1 took over after step 3 had reached the loop
        report("replica-1", 1, 4)
        report("replica-2", 0, 5)  # replica 2 took over; replica 1's step 5 was lost
        report("replica-2", 1, 6)
        assert [d["step"] for d in h.of("metrics")] == [1, 2, 3, 4, 5, 6]
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_a_workers_news_that_ray_delivers_swapped_is_logged_in_the_order_it_was_sent() -> None:
    async def body() -> None:
        h = Harness(FakeCluster(2))
        h.start()
        await h.workers_start(1, step=1)

        def news(n: int, step: int) -> None:
            data = {"attempt": 1, "step": step, "world_size": 2}
            h.loop.record("metrics", data, sender="rank-0", n=n)

        news(0, 2)
        news(2, 4)  # came before its predecessor, as Ray's async actors allow
        assert [d["step"] for d in h.of("metrics")] == [1, 2]
        news(1, 3)
        news(3, 5)
        assert [d["step"] for d in h.of("metrics")] == [1, 2, 3, 4, 5]
        # One whose predecessor never comes goes on after the hold; nothing waits for ever.
        news(5, 7)
        h.clock.now += 1.0
        h.loop.deliver_overdue()
        assert [d["step"] for d in h.of("metrics")] == [1, 2, 3, 4, 5, 7]
        h.loop.cancel("done")
        await h.finish()

    run(body)


def test_a_job_without_checkpoints_of_ours_progresses_by_getting_further() -> None:
    """A command job's script keeps its own checkpoints: an attempt that reached a step no
    earlier one had is progress, and the failures before it are forgiven; one that did not
    get further counts against max_restarts."""

    async def body() -> None:
        h = Harness(FakeCluster(1), max_restarts=1, own_checkpoints=True)
        h.start()
        for attempt, step in enumerate((5, 9, 14, 20), start=1):
            await h.workers_start(attempt, step=step)
            h.runner.end(AttemptOutcome("rank 0: CommandFailed: exited with status 1"))
        await h.workers_start(5, step=20)  # no further: 1st in a row, retried
        h.runner.end(AttemptOutcome("rank 0: CommandFailed: exited with status 1"))
        await h.workers_start(6, step=20)  # 2nd in a row: gives up
        h.runner.end(AttemptOutcome("rank 0: CommandFailed: exited with status 1"))
        await h.finish()
        assert h.loop.state == "failed"
        assert len(h.runner.specs) == 6

    run(body)


def test_a_job_whose_code_cannot_load_fails_at_once() -> None:
    """A misspelt function or a module that does not import fails every attempt alike: the
    job fails on the first, with the workers' message, whatever max_restarts allows."""

    async def body() -> None:
        h = Harness(FakeCluster(2), max_restarts=3)
        h.start()
        await h.attempt(1)
        error = "rank 0: EntrypointError: cannot load m:f: AttributeError: no attribute 'f'"
        h.runner.end(AttemptOutcome(error, code_error=True))
        await h.finish()
        assert h.loop.state == "failed"
        assert h.of("state")[-1]["reason"] == f"{error} (its code cannot be loaded: not retried)"
        assert len(h.runner.specs) == 1

    run(body)
