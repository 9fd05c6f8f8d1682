"""The line between a worker and the confined child that runs a ``train_loop`` from its
job's code package (``elastic/train/loop_child.py``).

The child holds no Ray connection, so what a loop's context tells the supervisor goes up
a pipe as JSON lines, and the worker, which holds the connection, passes it on:

- ``{"emit": kind, "data": {...}}``: an event (metrics, a checkpoint, a failure signal);
- ``{"ask": "pause", "step": n}``: rank 0 at a checkpoint, asking whether the job stops
  here to grow; the worker asks the supervisor and answers ``{"pause": bool}`` down the
  second pipe;
- ``{"code_error": text}``: the entrypoint cannot load, which no retry mends;
- anything else is a point of ``elastic_train.report``, which writes to the same pipe.

Down the second pipe the worker also sends ``{"drain": true}`` once a node of the attempt
is draining, so the loop stops at its next step boundary.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from elastic.events import EventKind
from elastic.train.worker import WorkerContext

log = logging.getLogger(__name__)

# How long rank 0's child waits for the supervisor's answer about a pause: the worker asks
# with a 30 s timeout of its own.
ANSWER_WAIT_S = 60.0
ATTACH_WAIT_S = 10.0


# What a loop's context emits, and the fields of each that the supervisor and the service
# read as numbers: nothing else a child sends is passed on, since the child runs the
# owner's code and its lines may say anything.
RELAYED: dict[str, tuple[str, ...]] = {
    EventKind.METRICS: ("step",),
    EventKind.CHECKPOINT_SAVED: ("step", "size_bytes", "created_at"),
    EventKind.CHECKPOINT_REMOVED: ("step",),
    EventKind.CHECKPOINT_CORRUPT: ("step",),
    EventKind.FAILURE_SIGNAL: (),
    # An in-place replica's quorum changes (elastic/in_place/steps.py ``quorum_events``),
    # announced by the quorum's rank 0.
    EventKind.WORKER_LOST: ("from_world", "to_world", "step"),
    EventKind.JOINED: ("from_world", "to_world", "step"),
    EventKind.RESIZED: ("from_world", "to_world", "step"),
}
NUMBERS = frozenset(
    {
        "step",
        "completed_step",
        "world_size",
        "total_steps",
        "size_bytes",
        "created_at",
        "time",
        "rank",
        "loss",
        "samples_per_s",
        "from_world",
        "to_world",
        "steps_redone",
        "pause_seconds",
        "recovery_seconds",
        "longest_pause_s",
    }
)


def relayable(kind: str, data: Any) -> str | None:
    """Why an event from a loop's child is not passed on; None when it is."""
    if kind not in RELAYED:
        return f"not an event a loop sends: {kind[:40]!r}"
    if not isinstance(data, dict):
        return "its data is not an object"
    for name in RELAYED[kind]:
        if name not in data:
            return f"{kind} without {name!r}"
    for name, value in data.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in NUMBERS and value is not None and not number:
            return f"{kind}: {name!r} is not a number"
        if name == "path" and not isinstance(value, str):
            return f"{kind}: 'path' is not a string"
    return None


def child_config(config: dict[str, Any]) -> dict[str, Any]:
    """What of a worker's config a loop's child gets: the loop's, not the service's (its
    command plan, its MLflow target: the child holds no MLflow credentials)."""
    return {k: v for k, v in config.items() if k not in ("command", "_mlflow")}


def _plain(value: Any) -> Any:
    """JSON for what an event may hold besides JSON's own types (a 0-d tensor, a path)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (RuntimeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, default=_plain) + "\n").encode()


class ParentLink:
    """The child's end: writes go up ``send_fd``; a thread reads the answers."""

    def __init__(
        self,
        send_fd: int,
        reply_fd: int,
        on_message: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._send_fd = send_fd
        self._lock = threading.Lock()
        self._answers: queue.Queue[bool] = queue.Queue()
        self.drained = threading.Event()
        # Every other message down the pipe (an in-place replica's child: elastic/in_place/
        # child_link.py), handled on the reading thread: an abort must not wait on the loop.
        self.on_message = on_message
        threading.Thread(
            target=self._read, args=(reply_fd,), name="etrain-parent-link", daemon=True
        ).start()

    @classmethod
    def from_environment(
        cls, on_message: Callable[[dict[str, Any]], None] | None = None
    ) -> ParentLink:
        from elastic.train.command_env import REPLY_FD_ENV, REPORT_FD_ENV

        return cls(int(os.environ[REPORT_FD_ENV]), int(os.environ[REPLY_FD_ENV]), on_message)

    def _read(self, reply_fd: int) -> None:
        with os.fdopen(reply_fd, "rb") as pipe:
            for raw in pipe:
                message = json.loads(raw)
                if not isinstance(message, dict):
                    continue
                if message.get("drain"):
                    self.drained.set()
                elif "pause" in message:
                    self._answers.put(bool(message["pause"]))
                elif self.on_message is not None:
                    self.on_message(message)

    def send(self, message: dict[str, Any]) -> None:
        line = encode(message)
        with self._lock:  # the checkpoint writer's thread sends too
            view = memoryview(line)
            while view:
                view = view[os.write(self._send_fd, view) :]

    def ask_pause(self, step: int) -> bool:
        self.send({"ask": "pause", "step": step})
        return self._answers.get(timeout=ANSWER_WAIT_S)


@dataclass
class PipedWorker(WorkerContext):
    """A worker's context inside the child: what it would tell or ask the supervisor goes
    through the worker that started it."""

    link: ParentLink | None = None

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        assert self.link is not None
        self.link.send({"emit": kind, "data": data})

    def should_pause(self, step: int) -> bool:
        assert self.link is not None
        return self.link.ask_pause(step)

    def watch_for_drain(self, every_s: float = 0.0) -> None:
        """The worker watches; its word arrives on the link."""

    def drain_noticed(self) -> bool:
        return self.link is not None and self.link.drained.is_set()


class ChildRelay:
    """The worker's end: each line from the child, handled as the module says. Runs on the
    thread that reads the pipe; answers go down ``replies``."""

    def __init__(self, worker: WorkerContext, report_line: Callable[[bytes], None] | None) -> None:
        self.worker = worker
        self.report_line = report_line
        self.code_error: str | None = None
        self._replies: IO[bytes] | None = None
        self._attached = threading.Event()
        self._lock = threading.Lock()

    def attach(self, replies: IO[bytes]) -> None:
        """The pipe down to the child, known once it is started (its lines may come first)."""
        self._replies = replies
        self._attached.set()

    def _answer(self, message: dict[str, Any]) -> bool:
        """Whether the message went down the pipe (not when the child is gone)."""
        self._attached.wait(ATTACH_WAIT_S)
        with self._lock:
            if self._replies is None:
                return False
            try:
                self._replies.write(encode(message))
                self._replies.flush()
            except (BrokenPipeError, ValueError, OSError):  # the child is gone
                return False
            return True

    def line(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            log.warning("a line from the loop's process is not JSON: %r", raw[:200])
            return
        if not isinstance(message, dict):
            return
        if "emit" in message:
            kind, data = str(message["emit"]), message.get("data")
            why_not = relayable(kind, data)
            if why_not is not None:
                log.warning("an event from the loop's process is dropped: %s", why_not)
                return
            assert isinstance(data, dict)
            done = data.get("completed_step")
            if isinstance(done, int):
                self.worker.completed_step = max(self.worker.completed_step, done)
            self.worker.emit(kind, data)
        elif message.get("ask") == "pause":
            self._answer({"pause": self.worker.should_pause(int(message["step"]))})
        elif "code_error" in message:
            self.code_error = str(message["code_error"])
        elif self.report_line is not None:
            self.report_line(raw)

    def tell_drain(self) -> None:
        self._answer({"drain": True})
