"""Restart mode's warm pool, its pure decisions without Ray: which warm workers an attempt
takes, what an attempt's end reports, and how the supervisor's loop counts warm workers as
capacity the job holds (a fake runner that keeps its workers between attempts)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import pytest

from elastic.cluster.reservation import Reservation
from elastic.restart import runner as warm_pool
from elastic.restart import worker as warm_worker
from elastic.restart.node_probe import NodeAnswer, NodeProbe
from elastic.restart.runner import (
    Ending,
    Member,
    WarmPoolRunner,
    choose_warm,
    dead_by,
    settle_deadline,
)
from elastic.restart.worker import WarmWorker
from elastic.supervisor.attempt import AttemptOutcome
from elastic.supervisor.loop import Timing
from elastic.supervisor.runner import AttemptSpec
from tests.unit.elastic.supervisor.test_loop import FakeCluster, FakeRunner, Harness, run


def member(node: str | None) -> Member:
    return Member(actor=f"actor-{node}", ready=None, node=node, pid=1)


def test_an_attempt_takes_warm_workers_in_order_and_lets_go_of_avoided_and_surplus_ones() -> None:
    a, b, c, d = member("n0"), member("n1"), member("n2"), member("n3")
    assert choose_warm([a, b, c, d], 2, {"n1"}) == ([a, c], [b, d])
    assert choose_warm([a, b], 3, set()) == ([a, b], [])
    assert choose_warm([a, b], 2, {"n0", "n1"}) == ([], [a, b])


def test_a_grow_s_workers_warm_while_the_attempt_trains_and_the_next_attempt_takes_them() -> None:
    """Each new worker is placed on its own reserved slot; those ready join the warm ones,
    one that died is killed (its slot with it). An attempt that starts while some still warm
    takes what it needs of them as they are, and lets the rest go."""

    async def body() -> None:
        runner = WarmPoolRunner({"resources_per_worker": {"CPU": 1.0}}, lambda spec: {})
        killed: list[Member] = []
        runner._kill = killed.append  # type: ignore[method-assign,assignment]
        loop = asyncio.get_running_loop()
        placed: dict[str, Member] = {}

        def place(group: Any = None) -> Member:
            placed[group] = Member(f"actor-{group}", loop.create_future(), group=group)
            return placed[group]

        runner._place = place  # type: ignore[method-assign]
        warming = asyncio.ensure_future(
            runner.warm_ahead([Reservation(1, "g1"), Reservation(1, "g2")])
        )
        await asyncio.sleep(0)
        assert runner.warming == [placed["g1"], placed["g2"]] and runner.warm_workers() == 0
        placed["g1"].ready.set_result(("n5", 50))
        placed["g2"].ready.set_exception(RuntimeError("its node died"))
        assert await warming == 1
        assert [(m.node, m.pid) for m in runner.idle] == [("n5", 50)]
        assert killed == [placed["g2"]] and runner.warm_workers() == 1

        warm = member("n0")
        runner.idle = [warm]
        later = asyncio.ensure_future(
            runner.warm_ahead([Reservation(1, "g3"), Reservation(1, "g4")])
        )
        await asyncio.sleep(0)
        assert runner._take(2, set()) == [warm, placed["g3"]]
        assert killed[-1] is placed["g4"] and runner.warming == []
        placed["g3"].ready.set_result(("n6", 60))
        placed["g4"].ready.set_result(("n7", 70))
        assert await later == 0 and runner.idle == []  # g3 is the attempt's; g4 went

    run(body)


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
    # Rank 0's own error came back last, but it failed first: its peers failed because it
    # shut its connections.
    ending.errors += [
        (1000.2, 2, "RuntimeError: Connection closed by peer"),
        (1000.1, 0, "ValueError: the user's own error"),
    ]
    ending.failed(11.0)  # the first failure is kept
    assert ending.failed_at == 10.0
    assert ending.outcome(stopped=False) == AttemptOutcome(
        "rank 0: ValueError: the user's own error", [1]
    )
    # Stopped by the supervisor: the cause is the supervisor's, the workers' errors follow it.
    assert ending.outcome(stopped=True) == AttemptOutcome(None, [1])


def test_the_others_get_a_bounded_while_after_the_first_failure_and_none_before() -> None:
    assert settle_deadline(None) is None
    assert settle_deadline(100.0, 5.0) == 105.0


class Told:
    """A worker actor's method whose calls are only recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def remote(self, *args: object) -> None:
        self.calls.append(args)


class Answered:
    """One method of a worker actor: each call counted, and answered at once with
    ``value()`` while ``answers()`` holds, else never (its node is gone)."""

    def __init__(self, answers: Callable[[], bool], value: Callable[[], object]) -> None:
        self.answers, self.value = answers, value
        self.calls = 0

    def remote(self, *args: object) -> asyncio.Future[object]:
        self.calls += 1
        answer: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.answers():
            answer.set_result(self.value())
        return answer


class PingedActor:
    """A worker actor's ``ping``: answered at once, or never (its node is gone); its
    ``joined``: at once, yes, for one that joined the attempt's group (``joined``), else as
    its pings are, with no; and its ``abandon``, recorded."""

    def __init__(self, answers: bool, joined: bool = True) -> None:
        self.answers, self.has_joined = answers, joined
        self.ping = Answered(lambda: self.answers, lambda: None)
        self.joined = Answered(lambda: self.has_joined or self.answers, lambda: self.has_joined)
        self.abandon = Told()

    @property
    def pings(self) -> int:
        return self.ping.calls


ATTEMPT = 7


class Nodes:
    """What each node's kernel answers to a handshake with its raylet, as the test sets it;
    and how often it was asked."""

    def __init__(self) -> None:
        self.answers = {"n0": NodeAnswer.UP, "n1": NodeAnswer.UP}
        self.asked: list[str] = []

    def probe(self) -> NodeProbe:
        async def shake(host: str, port: int) -> NodeAnswer:
            self.asked.append(host)
            return self.answers[host]

        return NodeProbe(lambda: {n: (n, 1) for n in self.answers}, shake)


@dataclass
class Watched:
    """A runner watching an attempt's two runs, neither ended yet: rank 0 (``survivor``, on
    node n0, which answers) and rank 1 (``other``, on node n1). The workers it kills (Ray's
    part) go to ``killed``."""

    survivor: PingedActor
    other: PingedActor
    nodes: Nodes
    killed: list[Member]
    runner: WarmPoolRunner
    ending: Ending
    watch: asyncio.Future[None]


def watching(answers: bool, node: NodeAnswer = NodeAnswer.UP, joined: bool = True) -> Watched:
    """``answers``: whether rank 1 answers its pings; ``node``: what its node answers;
    ``joined``: whether both have joined the attempt's group already."""
    survivor = PingedActor(answers=True, joined=joined)
    other = PingedActor(answers=answers, joined=joined)
    nodes, killed = Nodes(), list[Member]()
    nodes.answers["n1"] = node
    runner = WarmPoolRunner({"resources_per_worker": {"CPU": 1.0}}, lambda spec: {})
    runner._kill = killed.append  # type: ignore[method-assign,assignment]
    runner.probe = nodes.probe()
    runner.busy = {0: Member(survivor, None, "n0", 10), 1: Member(other, None, "n1", 11)}
    ending = runner.ending = Ending(nodes={0: "n0", 1: "n1"})
    loop = asyncio.get_running_loop()
    runs: dict[asyncio.Future[object], int] = {loop.create_future(): 0, loop.create_future(): 1}
    wakes: set[asyncio.Future[Any]] = {asyncio.ensure_future(runner.signalled.wait())}
    wakes.add(asyncio.ensure_future(runner.stopped.wait()))
    watch = asyncio.ensure_future(runner._watch_runs(runs, wakes, ending, ATTEMPT))
    return Watched(survivor, other, nodes, killed, runner, ending, watch)


async def until(check: Callable[[], bool], within_s: float = 5.0) -> float:
    """Seconds until ``check`` holds (polled); fails past ``within_s``."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < within_s, "not within the bound"
        await asyncio.sleep(0.01)
    return time.monotonic() - began


def test_a_worker_s_failure_signal_starts_the_pings_before_any_run_returns() -> None:
    """A survivor's run returns only after its last checkpoint write and log lines (over a
    second on a busy machine): its failure signal, which comes first, starts the search for
    the dead ones. A worker whose ping is silent and whose node refuses is dead at once."""

    async def body() -> None:
        w = watching(answers=False, node=NodeAnswer.GONE)
        await asyncio.sleep(0.2)
        assert (w.survivor.pings, w.other.pings, w.ending.failed_at) == (0, 0, None)
        assert w.survivor.abandon.calls == w.other.abandon.calls == []

        w.runner.failure_signalled()
        found = await until(lambda: bool(w.ending.dead))
        assert w.ending.failed_at is not None
        # Both told at once to leave the collectives they wait in, once: the survivor's
        # may wait on a peer that failed and left, whose sockets stay open.
        assert w.survivor.abandon.calls == w.other.abandon.calls == [(ATTEMPT,)]
        assert w.ending.dead == {1} and list(w.runner.busy) == [0]  # rank 0 ends itself
        assert [m.actor for m in w.killed] == [w.other] and w.other.pings == 1
        assert w.nodes.asked == ["n1"]  # the node of the silent one only
        assert warm_pool.ASK_NODE_S <= found < warm_pool.PING_S
        await asyncio.sleep(3 * warm_pool.PING_EVERY_S)
        assert w.survivor.pings >= 2  # the living are asked again
        assert not w.watch.done()  # waiting for rank 0's run, within SETTLE_S
        w.watch.cancel()

    asyncio.run(body())


def test_a_worker_that_dies_before_it_joined_fails_the_attempt_at_once() -> None:
    """Until a worker has joined the attempt's group, it is asked whether it has: one that
    died then (its node gone a moment after the attempt began) sends nothing its peers could
    fail on, so they would wait in the join. Found dead, it fails the attempt, and the
    others are told to give up their join."""

    async def body() -> None:
        w = watching(answers=False, node=NodeAnswer.GONE, joined=False)
        found = await until(lambda: bool(w.ending.dead))
        assert w.ending.dead == {1} and w.ending.failed_at is not None
        assert [m.actor for m in w.killed] == [w.other] and list(w.runner.busy) == [0]
        assert w.survivor.abandon.calls == [(ATTEMPT,)] and w.other.abandon.calls == []
        assert w.nodes.asked == ["n1"] and found < warm_pool.PING_S
        assert w.ending.outcome(stopped=False) == AttemptOutcome(
            "rank 1: its worker died (its process or its node was lost)",
            [1],
            dead_nodes={1: "n1"},  # the supervisor has no word of it from the worker yet
        )
        w.watch.cancel()

    asyncio.run(body())


def test_workers_are_asked_until_they_joined_and_then_left_alone() -> None:
    """A healthy attempt costs its workers a few questions at its start, none once each one
    has joined, until a failure."""

    async def body() -> None:
        w = watching(answers=True, joined=False)
        await until(lambda: w.survivor.joined.calls >= 2 and w.other.joined.calls >= 2)
        w.survivor.has_joined = w.other.has_joined = True
        await asyncio.sleep(2 * warm_pool.PING_EVERY_S)
        asked = (w.survivor.joined.calls, w.other.joined.calls)
        await asyncio.sleep(5 * warm_pool.PING_EVERY_S)
        assert (w.survivor.joined.calls, w.other.joined.calls) == asked
        assert (w.survivor.pings, w.other.pings, w.nodes.asked) == (0, 0, [])
        assert w.ending.failed_at is None and w.ending.dead == set() and w.killed == []
        w.watch.cancel()

    asyncio.run(body())


def test_rank_0_lost_while_it_opens_the_store_fails_the_attempt_without_waiting_for_ray() -> None:
    """Rank 0's node died a moment before the attempt: its call to open the store would
    wait for Ray's membership (seconds). Its pings find it, and the attempt ends with the
    others back in the pool."""

    class LostRank0(PingedActor):
        def __init__(self) -> None:
            super().__init__(answers=False)
            self.open_store = Answered(lambda: False, lambda: None)

    async def body() -> None:
        nodes, killed = Nodes(), list[Member]()
        nodes.answers["n0"] = NodeAnswer.GONE
        runner = WarmPoolRunner({"collective_timeout_s": 30.0}, lambda spec: {})
        runner._kill = killed.append  # type: ignore[method-assign,assignment]
        runner.probe = nodes.probe()
        lost, survivor = LostRank0(), PingedActor(answers=True)
        runner.busy = {0: Member(lost, None, "n0", 10), 1: Member(survivor, None, "n1", 11)}
        ending = Ending()
        began = time.monotonic()
        await asyncio.wait_for(runner._train(AttemptSpec(ATTEMPT, 2, None), ending), 5.0)
        assert time.monotonic() - began < warm_pool.PING_S
        assert ending.dead == {0} and ending.failed_at is not None
        assert lost.open_store.calls == 1 and nodes.asked == ["n0"]
        assert [m.actor for m in runner.idle] == [survivor] and list(runner.busy) == [0]

    asyncio.run(body())


def test_a_silent_ping_is_a_death_only_by_the_node_s_answer() -> None:
    assert dead_by(NodeAnswer.GONE, 0.0)
    assert not dead_by(NodeAnswer.UP, 0.0) and not dead_by(NodeAnswer.UP, 60.0)
    assert not dead_by(NodeAnswer.SILENT, warm_pool.PING_S - 0.01)
    assert dead_by(NodeAnswer.SILENT, warm_pool.PING_S)
    assert not dead_by(None, 60.0)


def test_a_worker_that_answered_and_then_died_is_found_by_its_next_ping() -> None:
    """Two nodes of one rack lost 0.3 s apart: the second one's worker answers the first
    pings, then goes silent with its node; its next ping finds it, long before its run's call
    fails (which waits for Ray to learn of the node's death)."""

    async def body() -> None:
        w = watching(answers=True)
        w.runner.failure_signalled()
        await until(lambda: w.other.pings >= 2)  # answered, and asked again
        assert w.ending.dead == set() and w.nodes.asked == []
        w.other.answers, w.nodes.answers["n1"] = False, NodeAnswer.GONE  # its node goes now
        found = await until(lambda: bool(w.ending.dead))
        assert w.ending.dead == {1} and list(w.runner.busy) == [0]
        assert [m.actor for m in w.killed] == [w.other]
        assert not w.watch.done()  # the survivor's run ends by itself
        # One more ping PING_EVERY_S on, silent for ASK_NODE_S, and the node gone: about
        # 0.3 s, held only to under PING_S, since a loaded machine (CI's, beside the hosts
        # tests) delays this loop's wake-ups by tenths of a second.
        assert warm_pool.ASK_NODE_S <= found < warm_pool.PING_S
        w.watch.cancel()

    asyncio.run(body())


def test_a_slow_worker_on_a_node_that_answers_is_not_counted_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy machine holds a live worker's answer past PING_S: its node completes the
    handshake each time it is asked, so the worker is pinged again, never counted dead."""
    monkeypatch.setattr(warm_pool, "PING_S", 0.3)

    async def body() -> None:
        w = watching(answers=False)
        w.runner.failure_signalled()
        await until(lambda: w.other.pings >= 3)
        assert w.ending.dead == set() and w.killed == [] and set(w.runner.busy) == {0, 1}
        assert set(w.nodes.asked) == {"n1"} and len(w.nodes.asked) >= 2 * 2  # each ping, often
        w.watch.cancel()

    asyncio.run(body())


def test_a_node_that_answered_while_it_was_dying_is_asked_again_soon() -> None:
    """A host's processes are killed one by one: its kernel may still complete the
    handshake when first asked, then refuse. The node is asked again every ASK_NODE_S, so
    its worker is dead well before PING_S."""

    async def body() -> None:
        w = watching(answers=False)
        w.runner.failure_signalled()
        began = time.monotonic()
        await until(lambda: w.nodes.asked.count("n1") >= 1)
        w.nodes.answers["n1"] = NodeAnswer.GONE
        found = await until(lambda: bool(w.ending.dead))
        assert w.ending.dead == {1} and w.nodes.asked == ["n1", "n1"]
        assert time.monotonic() - began < 2 * warm_pool.ASK_NODE_S + 0.3 < warm_pool.PING_S
        assert found < warm_pool.ASK_NODE_S + 0.3
        w.watch.cancel()

    asyncio.run(body())


def test_a_worker_on_a_node_that_does_not_answer_is_dead_after_ping_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node cut off (or powered off) answers nothing: its worker is dead once its ping was
    silent for PING_S, the node asked once."""
    monkeypatch.setattr(warm_pool, "PING_S", 0.5)

    async def body() -> None:
        w = watching(answers=False, node=NodeAnswer.SILENT)
        w.runner.failure_signalled()
        found = await until(lambda: bool(w.ending.dead))
        assert w.ending.dead == {1} and w.nodes.asked == ["n1"] and w.other.pings == 1
        assert 0.5 <= found < 0.8
        w.watch.cancel()

    asyncio.run(body())


def test_after_the_supervisor_s_stop_a_dead_worker_is_still_found() -> None:
    """Ray's membership saw a first node leave and the supervisor stopped the attempt before
    any worker failed: the runs still going are pinged, and a second lost node's worker is
    counted dead, so the attempt's end names it too."""

    async def body() -> None:
        w = watching(answers=False, node=NodeAnswer.GONE)
        w.runner.stop()
        await until(lambda: bool(w.ending.dead))
        assert w.ending.failed_at is None and w.ending.dead == {1}
        assert w.ending.outcome(stopped=True) == AttemptOutcome(None, [1], dead_nodes={1: "n1"})
        assert w.survivor.abandon.calls == w.other.abandon.calls == [(ATTEMPT,)]
        w.watch.cancel()

    asyncio.run(body())


def test_a_failure_signal_between_attempts_or_while_stopping_is_ignored() -> None:
    runner = WarmPoolRunner({"resources_per_worker": {"CPU": 1.0}}, lambda spec: {})
    runner.failure_signalled()  # no attempt running
    assert not runner.signalled.is_set()
    runner.ending = Ending()
    runner.stopping = True  # the supervisor stopped it: its workers' errors are its own doing
    runner.failure_signalled()
    assert runner.ending.failed_at is None and not runner.signalled.is_set()


def test_a_stuck_worker_tells_where_its_training_thread_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before a run that outlived the settle bound is killed, its training thread's stack goes
    into the job's log (the worker's stderr, which its run forwards)."""
    monkeypatch.setattr(warm_worker, "FLUSH_S", 0.0)
    cls = WarmWorker.__ray_actor_class__  # the actor's own class, without Ray
    worker = cls.__new__(cls)  # no __init__: it binds Gloo to the node and watches its parent
    worker.training_thread = None
    assert worker.where(1, 5.0) == ""  # between runs: nothing to tell
    blocked, release = threading.Event(), threading.Event()

    def blocked_in_a_collective() -> None:  # stands for a run that waits on a peer
        worker.training_thread = threading.get_ident()
        blocked.set()
        release.wait(10)

    thread = threading.Thread(target=blocked_in_a_collective)
    thread.start()
    blocked.wait(10)
    try:
        stack = worker.where(1, 5.0)
    finally:
        release.set()
        thread.join(10)
    assert "in blocked_in_a_collective" in stack and "release.wait(10)" in stack
    err = capsys.readouterr().err
    assert "rank 1 did not end within 5 s of the attempt's failure" in err
    assert "in blocked_in_a_collective" in err


class WarmFakeRunner(FakeRunner):
    """As the warm pool: an attempt's surviving workers keep their nodes when it ends."""

    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__(cluster)
        self.warm: list[str] = []

    def warm_workers(self, exclude: Collection[str] = ()) -> int:
        return sum(1 for n in self.warm if n not in exclude)

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


async def warm_job_at_step_10(cluster: FakeCluster) -> Harness:
    """A restart-mode job on the warm pool, on every node of ``cluster``, with its
    checkpoint of step 10 saved. Its loop's release wait and poll are far longer than any
    test's bound, so that a wait on either would show."""
    h = Harness(cluster, max_restarts=0)
    h.runner = WarmFakeRunner(cluster)
    h.loop.runner = h.runner
    h.loop.timing = Timing(poll_s=5, release_wait_s=5, reserve_s=0.01, start_s=30)
    h.start()
    await h.workers_start(1, step=1)
    h.saved(1, 10)
    return h


def test_a_loss_restarts_at_once_on_the_warm_survivors_without_waiting_for_release() -> None:
    async def body() -> None:
        cluster = FakeCluster(3)
        h = await warm_job_at_step_10(cluster)
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


def test_a_worker_gives_up_only_the_attempt_it_runs() -> None:
    """Word of an earlier attempt, late, leaves the current one's collectives alone."""
    cls = WarmWorker.__ray_actor_class__  # the actor's own class, without Ray
    worker = cls.__new__(cls)  # no __init__: it binds Gloo to the node and watches its parent
    worker.attempt, worker.abandoned, worker.group, worker.joining = (
        3,
        threading.Event(),
        None,
        None,
    )
    worker.abandon(2)
    assert not worker.abandoned.is_set()
    worker.abandon(3)
    assert worker.abandoned.is_set()


def test_a_worker_lost_before_it_registered_is_a_loss_of_its_node() -> None:
    """Two nodes lost a moment apart: the second dies while the restart's group forms,
    before its worker registered with the supervisor, and before the membership knows. The
    runner names its node, so it is a second loss (not a failure that would wait for its
    workers' release), and the next attempt starts at once without it."""

    async def body() -> None:
        h = await warm_job_at_step_10(FakeCluster(3))
        first = h.runner.nodes[2]
        h.capacity.silent.add(first)
        h.runner.end(AttemptOutcome("rank 0: RuntimeError: Connection reset by peer", [2]))
        assert (await h.attempt(2)).world_size == 2
        second = h.runner.nodes[1]  # attempt 2's rank 1, not registered yet
        h.capacity.silent.add(second)
        began = time.monotonic()
        h.runner.end(
            AttemptOutcome(
                "rank 1: its worker died (its process or its node was lost)",
                [1],
                dead_nodes={1: second},
            )
        )
        spec = await h.attempt(3)
        assert time.monotonic() - began < 1.0
        assert spec == AttemptSpec(3, 1, "/c/step_10", frozenset({first, second}))
        assert [(x["from_world"], x["nodes"], x["ranks"]) for x in h.of("worker_lost")] == [
            (3, [first], [2]),
            (2, [second], [1]),
        ]
        await h.workers_start(3, step=11)
        (resized,) = h.of("resized")
        assert (resized["from_world"], resized["to_world"], resized["attempts"]) == (3, 1, 2)
        h.runner.end(AttemptOutcome())
        await h.finish()
        assert h.states() == ["starting", "running", "recovering", "running", "succeeded"]

    run(body)
