"""Restart mode's warm pool, its pure decisions without Ray: which warm workers an attempt
takes, what an attempt's end reports, and how the supervisor's loop counts warm workers as
capacity the job holds (a fake runner that keeps its workers between attempts)."""

from __future__ import annotations

import asyncio
import time

from elastic.attempt import AttemptOutcome
from elastic.attempt_runner import AttemptSpec
from elastic.job_loop import Timing
from elastic.warm_pool import Ending, Member, WarmPoolRunner, choose_warm, settle_deadline
from tests.unit.test_supervisor_loop import FakeCluster, FakeRunner, Harness, run


def member(node: str | None) -> Member:
    return Member(actor=f"actor-{node}", ready=None, node=node, pid=1)


def test_an_attempt_takes_warm_workers_in_order_and_lets_go_of_avoided_and_surplus_ones() -> None:
    a, b, c, d = member("n0"), member("n1"), member("n2"), member("n3")
    assert choose_warm([a, b, c, d], 2, {"n1"}) == ([a, c], [b, d])
    assert choose_warm([a, b], 3, set()) == ([a, b], [])
    assert choose_warm([a, b], 2, {"n0", "n1"}) == ([], [a, b])


def test_the_pool_counts_its_warm_workers_off_suspected_nodes() -> None:
    runner = WarmPoolRunner({"resources_per_worker": {"CPU": 1.0}}, lambda spec: {})
    runner.idle = [member("n0"), member("n1"), member("n2")]
    assert runner.warm_workers() == 3
    assert runner.warm_workers({"n1": 1000.0}) == 2
    assert runner.warm_workers(["n0", "n2"]) == 1


def test_an_attempt_s_end_names_the_first_error_and_the_dead_ranks() -> None:
    ending = Ending()
    assert ending.outcome(stopped=False) == AttemptOutcome()
    ending.dead.add(1)
    ending.failed(10.0)
    assert ending.outcome(stopped=False) == AttemptOutcome(
        "rank 1: its worker died (its process or its node was lost)", [1]
    )
    ending.errors += [(2, "RuntimeError: Connection closed by peer"), (0, "RuntimeError: x")]
    ending.failed(11.0)  # the first failure is kept
    assert ending.failed_at == 10.0
    assert ending.outcome(stopped=False) == AttemptOutcome(
        "rank 2: RuntimeError: Connection closed by peer", [1]
    )
    # Stopped by the supervisor: the cause is the supervisor's, the workers' errors follow it.
    assert ending.outcome(stopped=True) == AttemptOutcome(None, [1])


def test_the_others_get_a_bounded_while_after_the_first_failure_and_none_before() -> None:
    assert settle_deadline(None) is None
    assert settle_deadline(100.0, 5.0) == 105.0


class WarmFakeRunner(FakeRunner):
    """As the warm pool: an attempt's surviving workers keep their nodes when it ends."""

    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__(cluster)
        self.warm: list[str] = []

    def warm_workers(self, exclude: object = ()) -> int:
        return sum(1 for n in self.warm if n not in exclude)  # type: ignore[operator]

    def close(self) -> None:
        for node in self.warm:
            self.cluster.give(node)
        self.warm = []

    async def run(self, spec: AttemptSpec) -> AttemptOutcome:
        self.specs.append(spec)
        keep = [n for n in self.warm if n not in spec.avoid][: spec.world_size]
        for node in self.warm:
            if node not in keep:
                self.cluster.give(node)
        new = self.cluster.free_nodes()[: spec.world_size - len(keep)]
        for node in new:
            self.cluster.take(node)
        self.nodes, self.warm = keep + new, []
        self.ending = asyncio.get_running_loop().create_future()
        outcome = await self.ending
        dead = {self.nodes[r] for r in outcome.dead_ranks}
        for node in dead:
            self.cluster.give(node)
        self.warm = [n for n in self.nodes if n not in dead]
        return outcome


def test_a_loss_restarts_at_once_on_the_warm_survivors_without_waiting_for_release() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        h = Harness(cluster, max_restarts=0)
        h.runner = WarmFakeRunner(cluster)
        h.loop.runner = h.runner
        # A release wait or a poll would show: both far longer than the test's bound.
        h.loop.timing = Timing(poll_s=5, release_wait_s=5, reserve_s=0.01, start_s=30)
        h.start()
        await h.workers_start(1, step=1)
        h.saved(1, 10)
        dead = h.runner.nodes[1]
        h.capacity.silent.add(dead)  # the membership has not caught up yet
        began = time.monotonic()
        h.runner.end(AttemptOutcome("rank 0: RuntimeError: Connection closed by peer", [1]))
        spec = await h.attempt(2)
        assert time.monotonic() - began < 1.0
        assert spec == AttemptSpec(2, 2, "/c/step_10", frozenset({dead}))
        assert h.runner.nodes == [n for n in ("n0", "n1", "n2") if n != dead]
        (lost,) = h.of("worker_lost")
        assert (lost["nodes"], lost["ranks"]) == ([dead], [1])
        await h.workers_start(2, step=11)
        (resized,) = h.of("resized")
        assert (resized["from_world"], resized["to_world"]) == (3, 2)
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["starting", "running", "recovering", "running", "succeeded"]
        # The job's end lets its warm workers go: every slot is free again.
        assert h.runner.warm == [] and cluster.free_nodes() == ["n0", "n1", "n2"]

    run(body)
