"""One in-place replica: a Ray actor running the job's ``train_loop`` with an
:class:`InPlaceContext` and its own torchft ``Manager`` (a replica group of one)."""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any

import ray

from elastic import warm_processes
from elastic.arrivals import Outbox
from elastic.checkpoint.directory import CheckpointDir
from elastic.events import EventKind
from elastic.in_place.manager import (  # noqa: F401  (tests find the first two here)
    RENDEZVOUS_TIMEOUT,
    START_TOGETHER_S,
    make_manager,
    node_bound_gloo,
    wait_for_starters,
)
from elastic.in_place.members import replica_id
from elastic.train.current import call_train_loop
from elastic.train.entrypoint import resolve
from elastic.train.orphan import die_with_parent
from elastic.train.worker_config import WorkerConfig
from elastic.train.worker_logs import LOG_FLUSH_S


# Threads: ``run`` trains; ``abort_step`` reaches it while a collective is in flight; each
# supervisor that watches the replica (the first, and each one re-created after a loss)
# waits in ``result``.
@ray.remote(max_restarts=0, max_concurrency=8)  # type: ignore[call-overload]
class Replica:
    def __init__(self) -> None:
        self.ctx: Any = None
        # A package loop's: the line to the child that runs it (elastic/in_place/child_link.py).
        self.relay: Any = None
        self.ended = threading.Event()
        self.outcome: str | BaseException | None = None
        # Its node's raylet gone, it ends at once (not at Ray's check a second later).
        die_with_parent()
        warm_processes.adopt(warm_processes.Kind.TRAINING)

    def result(self) -> str:
        """How its ``run`` ended, once it has: "finished" (it wrote the final checkpoint),
        "finished as a replica", or "left"; its error is raised. A supervisor waits here
        rather than on ``run``'s result, which dies with the supervisor that called it."""
        self.ended.wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome

    def abort_step(self, dropped_for_s: float) -> bool:
        """The supervisor heard that a replica of the job was dropped by the lighthouse
        ``dropped_for_s`` ago: discard the step in flight if its quorum may hold it (see
        elastic/in_place/abort.py). True when a step was discarded."""
        if self.relay is not None:
            return bool(self.relay.abort_step(dropped_for_s))
        if self.ctx is None:
            return False
        return bool(self.ctx.abort.request(dropped_for_s))

    def leave(self, save: bool) -> None:
        """Its node is draining: leave the quorum at the next step boundary (``save``: no
        other replica stays, so first checkpoint that step)."""
        if self.relay is not None:
            self.relay.leave(save)
        elif self.ctx is not None:
            self.ctx.save_on_leave = save
            self.ctx.leaving.set()

    def expect_drain(self) -> None:
        """Peers are leaving a draining node: the next shrink of the quorum is a drain."""
        if self.relay is not None:
            self.relay.expect_drain()
        elif self.ctx is not None:
            self.ctx.timeline.expect_drain()

    def run(self, *args: Any) -> None:
        """Train (the arguments are ``_run``'s); how it ended is for ``result``."""
        try:
            self.outcome = self._run(*args)
        except BaseException as e:
            self.outcome = e
        finally:
            self.ended.set()

    def _run_in_child(
        self,
        config: dict[str, Any],
        meta: dict[str, Any],
        worker: Any,
        supervisor: Any,
        replica: int,
        manager: dict[str, Any],
        send: Any,
    ) -> str:
        """A package loop's replica: the loop runs in a confined child (see
        elastic/in_place/replica_child.py), this actor its line to the supervisor."""
        from elastic.in_place.replica_child import run_package_loop
        from elastic.train.worker_logs import forward_output

        def attach(relay: Any) -> None:
            self.relay = relay

        try:
            with forward_output(send):
                return run_package_loop(config, meta, worker, supervisor, replica, manager, attach)
        finally:
            # The child's output and news are with the supervisor before the run ends.
            supervisor.flush(LOG_FLUSH_S)
            supervisor.close()

    def _run(
        self,
        config: dict[str, Any],
        replica: int,
        lighthouse: str,
        timeout_s: float,
        must_heal: bool,
        starting: int = 1,
    ) -> str:
        from elastic.in_place.context import InPlaceContext, LeftTheQuorum
        from elastic.in_place.supervisor_link import SupervisorLink
        from elastic.train.worker import WorkerContext
        from elastic.train.worker_logs import forward_output

        meta = WorkerConfig.from_dict(config["_elastic"])
        name, train_loop = meta.supervisor, meta.train_loop
        assert name is not None, "an in-place replica reports to its supervisor"
        assert train_loop is not None
        # The replica outlives its supervisor (see elastic/in_place/lighthouse.py): its calls
        # go to whichever supervisor the job has.
        supervisor = SupervisorLink(name, meta.namespace)
        supervisor.register_worker.remote(
            meta.attempt, replica, ray.get_runtime_context().get_node_id()
        )
        if meta.resume_path is not None and (
            must_heal or not CheckpointDir(meta.checkpoint_dir).exists(meta.resume_path)
        ):
            # A joiner takes the job's state from a peer (its heal) and never from storage:
            # the checkpoint its attempt began from may be gone, removed by retention once
            # the peers saved newer ones, and a heal overwrites all of it anyway.
            meta = dataclasses.replace(meta, resume_path=None)
            must_heal = True
        # Only a replica placed when the attempt started cleans a crashed writer's leftovers:
        # a joiner must not remove the staging directory of a write in flight.
        worker = WorkerContext(0 if replica == 0 else 1, 1, meta, supervisor)
        host = ray.util.get_node_ip_address() or socket.gethostname()

        def factory(load: Any, save: Any) -> Any:
            return make_manager(
                load,
                save,
                lighthouse=lighthouse,
                replica_id=replica_id(name, replica),
                timeout_s=timeout_s,
                host=host,
            )

        outbox = Outbox(supervisor)

        def send(lines: list[list[Any]]) -> None:
            outbox.record(EventKind.LOG, {"attempt": meta.attempt, "rank": replica, "lines": lines})

        if _runs_package_loop(config):
            return self._run_in_child(
                config,
                {**config["_elastic"], "resume_path": meta.resume_path},
                worker,
                supervisor,
                replica,
                {
                    "lighthouse": lighthouse,
                    "replica_id": replica_id(name, replica),
                    "timeout_s": timeout_s,
                    "host": host,
                    "must_heal": must_heal,
                    "starting": starting,
                },
                send,
            )

        def start_together() -> None:
            wait_for_starters(lighthouse, starting, START_TOGETHER_S)

        ctx = self.ctx = InPlaceContext(config, worker, factory, replica, must_heal, start_together)
        try:
            with forward_output(send):
                call_train_loop(resolve(train_loop), config, ctx)
                ctx.finish_steps()
            ctx.checkpoints.wait()
        except LeftTheQuorum:
            return "left"
        finally:
            # Its output and news are with the supervisor before its run ends (and with it,
            # maybe, the job); with a new supervisor, if the one it had died meanwhile.
            supervisor.flush(LOG_FLUSH_S)
            supervisor.close()
            # Its TensorBoard points and MLflow share, whatever happened; before the manager
            # stops heartbeating: a replica whose heartbeats stop is fenced as lost.
            worker.close()
            if ctx.manager is not None:
                ctx.manager.shutdown(wait=False)
        # The quorum's rank 0 wrote the final checkpoint: the runner waits for its word.
        return "finished" if worker.rank == 0 else "finished as a replica"


def _runs_package_loop(config: dict[str, Any]) -> bool:
    """A ``train_loop`` from the job's code package (``elastic.train.command.CommandPlan``)."""
    command = config.get("command")
    return isinstance(command, dict) and bool(command.get("entrypoint"))
