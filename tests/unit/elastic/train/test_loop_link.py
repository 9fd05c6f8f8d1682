"""The line between a worker and its loop's confined child: what the child's context
emits reaches the supervisor through the worker, and nothing else the child writes does."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from elastic.events import EventKind
from elastic.train.loop_link import ChildRelay, ParentLink, PipedWorker, relayable
from elastic.train.worker import WorkerContext
from elastic.train.worker_config import WorkerConfig


def test_only_the_events_a_loop_sends_with_numbers_where_numbers_belong_pass() -> None:
    assert relayable(EventKind.METRICS, {"step": 3, "loss": 0.5, "world_size": 2}) is None
    assert relayable(EventKind.METRICS, {"step": 3, "loss": None}) is None
    saved = {"step": 5, "size_bytes": 10, "created_at": 1.5, "path": "step_5"}
    assert relayable(EventKind.CHECKPOINT_SAVED, saved) is None
    assert relayable("state", {"state": "succeeded"}) == "not an event a loop sends: 'state'"
    assert relayable(EventKind.METRICS, {"loss": 1.0}) == "metrics without 'step'"
    assert relayable(EventKind.METRICS, {"step": "3"}) == "metrics: 'step' is not a number"
    assert relayable(EventKind.METRICS, {"step": True}) == "metrics: 'step' is not a number"
    assert relayable(EventKind.METRICS, [1]) == "its data is not an object"
    assert (
        relayable(EventKind.CHECKPOINT_SAVED, {**saved, "path": ["../x"]})
        == "checkpoint_saved: 'path' is not a string"
    )


def test_a_child_s_events_and_questions_go_through_its_worker(tmp_path: Path) -> None:
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=5)
    asked: list[int] = []

    def should_pause(step: int) -> bool:
        asked.append(step)
        return step == 10

    worker.should_pause = should_pause  # type: ignore[method-assign]
    up_read, up_write = os.pipe()
    down_read, down_write = os.pipe()
    points: list[bytes] = []
    relay = ChildRelay(worker, points.append)
    relay.attach(os.fdopen(down_write, "wb"))

    def pump() -> None:
        with os.fdopen(up_read, "rb") as pipe:
            for raw in pipe:
                relay.line(raw)

    reader = threading.Thread(target=pump)
    reader.start()
    link = ParentLink(up_write, down_read)
    child = PipedWorker(
        rank=0,
        world_size=1,
        config=WorkerConfig(checkpoint_dir=str(tmp_path), every_steps=5, keep=1, max_workers=1),
        supervisor=None,
        device=torch.device("cpu"),
        link=link,
    )
    child.emit(EventKind.METRICS, {"step": 4, "loss": torch.tensor(0.25), "completed_step": 4})
    child.emit("state", {"state": "succeeded"})  # not the child's to say: dropped
    assert child.should_pause(5) is False
    assert child.should_pause(10) is True
    link.send({"step": 4, "accuracy": 0.5})  # elastic_train.report's line
    link.send({"code_error": "cannot load train.py:loop"})
    assert not child.drain_noticed()
    relay.tell_drain()
    for _ in range(100):
        if child.drain_noticed():
            break
        threading.Event().wait(0.01)
    assert child.drain_noticed()
    os.close(up_write)
    reader.join(5)
    assert worker.local_events == [
        (EventKind.METRICS, {"attempt": 1, "step": 4, "loss": 0.25, "completed_step": 4})
    ]
    assert worker.completed_step == 4
    assert asked == [5, 10]
    assert [json.loads(p) for p in points] == [{"step": 4, "accuracy": 0.5}]
    assert relay.code_error == "cannot load train.py:loop"


def test_an_in_place_replica_s_quorum_events_pass_with_numbers_where_numbers_belong() -> None:
    from elastic.in_place.steps import QuorumChange, quorum_events

    change = QuorumChange("worker_lost", 21, 3, 2, 1, 0.4, 0.3, left=[2])
    for kind, data in quorum_events(change):
        assert relayable(kind, json.loads(json.dumps(data))) is None, kind
    lost = dict(quorum_events(change))[EventKind.WORKER_LOST]
    assert relayable(EventKind.WORKER_LOST, {**lost, "pause_seconds": "0"}) == (
        "worker_lost: 'pause_seconds' is not a number"
    )


class _Supervisor:
    """What a replica's actor calls: recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        outer = self

        class _Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args: object) -> None:
                outer.calls.append((self.name, args))

        self.replica_trained = _Method("replica_trained")
        self.record = _Method("record")


def test_a_replica_s_child_calls_only_allowed_calls_says_how_it_ended_and_answers_aborts(
    tmp_path: Path,
) -> None:
    from elastic.in_place.child_link import ReplicaControl, ReplicaRelay

    supervisor = _Supervisor()
    worker = WorkerContext.standalone(0, 1, str(tmp_path), every_steps=5, attempt=4)
    relay = ReplicaRelay(worker, supervisor, attempt=4, replica=2)
    up_read, up_write = os.pipe()
    down_read, down_write = os.pipe()
    relay.attach(os.fdopen(down_write, "wb"))

    def pump() -> None:
        with os.fdopen(up_read, "rb") as pipe:
            for raw in pipe:
                relay.line(raw)

    reader = threading.Thread(target=pump)
    reader.start()
    control = ReplicaControl()
    link = control.link = ParentLink(up_write, down_read, control.handle)

    class _Ctx:
        def __init__(self) -> None:
            self.leaving = threading.Event()
            self.save_on_leave = False
            self.drains = 0
            self.abort = self
            self.timeline = self

        def request(self, dropped_for_s: float) -> bool:
            return dropped_for_s < 1.0

        def expect_drain(self) -> None:
            self.drains += 1

    # Before the context exists, an abort finds no step; a leave is kept for it.
    assert relay.abort_step(0.2) is False
    relay.leave(True)
    ctx = _Ctx()
    deadline = threading.Event()
    deadline.wait(0.2)
    control.attach(ctx)
    assert ctx.leaving.is_set() and ctx.save_on_leave
    assert relay.abort_step(0.2) is True
    assert relay.abort_step(5.0) is False
    relay.expect_drain()
    link.send({"call": "replica_trained"})
    link.send({"call": "kill", "args": [1]})  # not a call a child may make
    link.send({"outcome": "anything"})
    link.send({"outcome": "finished as a replica"})
    os.close(up_write)
    reader.join(timeout=5)
    # The actor names its own attempt and replica: the child names only the call.
    assert supervisor.calls == [("replica_trained", (4, 2))]
    assert relay.outcome == "finished as a replica"
    for _ in range(100):  # read by the child's own thread
        if ctx.drains:
            break
        deadline.wait(0.05)
    assert ctx.drains == 1


_ACTOR = """
import os, subprocess, sys
from elastic.in_place.child_link import ReplicaRelay
from elastic.train.worker import WorkerContext
down_r, down_w = os.pipe()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(down_r)], pass_fds=[down_r])
os.close(down_r)
worker = WorkerContext.standalone(0, 1, sys.argv[2], every_steps=5)
ReplicaRelay(worker, None, attempt=1, replica=0).attach(os.fdopen(down_w, "wb"))
print(child.pid, flush=True)
print("child exited", child.wait(), flush=True)
"""

_CHILD = """
import os, sys, time
from elastic.in_place.child_link import ReplicaControl
from elastic.train.loop_link import ParentLink
control = ReplicaControl()
reply_fd = int(sys.argv[1])
_, up_w = os.pipe()
control.link = ParentLink(up_w, reply_fd, control.handle)
control.watch_parent(reply_fd, silent_s=1.0)
time.sleep(60)
"""


def _state(pid: int) -> str:
    """A process's state letter (Z once it exited and waits to be reaped); X when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_a_replica_s_child_stops_when_its_actor_is_stopped(tmp_path: Path) -> None:
    """The actor pings its child; stopped (SIGSTOP, as a hung process is), it pings no
    more, and its child exits about a second later (``silent_s``) with its own status,
    rather than heartbeat to the lighthouse on the hung actor's behalf."""
    import signal
    import subprocess
    import sys
    import time

    from elastic.in_place.child_link import PARENT_SILENT_EXIT

    actor = subprocess.Popen(
        [sys.executable, "-c", _ACTOR, _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert actor.stdout is not None
        child = int(actor.stdout.readline())
        time.sleep(2.5)  # the pings keep it: more than twice its silent_s
        assert _state(child) in ("S", "R"), _state(child)
        os.kill(actor.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while _state(child) not in ("Z", "X") and time.monotonic() - stopped < 10:
            time.sleep(0.05)
        took = time.monotonic() - stopped
        assert 0.9 < took < 3.0, took
        os.kill(actor.pid, signal.SIGCONT)
        assert actor.stdout.readline().strip() == f"child exited {PARENT_SILENT_EXIT}"
        assert actor.wait(timeout=10) == 0
    finally:
        actor.kill()
        actor.wait()
