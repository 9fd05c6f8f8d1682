"""One in-place replica: a Ray actor running the job's ``train_loop`` with an
:class:`InPlaceContext` and its own torchft ``Manager`` (a replica group of one)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import ray

from elastic.arrivals import Outbox
from elastic.checkpoint.directory import CheckpointDir
from elastic.events import EventKind
from elastic.in_place.heartbeats import ExtraHeartbeats
from elastic.in_place.members import QuorumMembers, replica_id
from elastic.train.entrypoint import resolve
from elastic.train.orphan import die_with_parent
from elastic.train.worker_config import WorkerConfig
from elastic.train.worker_logs import LOG_FLUSH_S

# The lighthouse forgets a replica whose heartbeats stop for this long. It is most of the
# survivors' pause after a loss: a dead peer's collective error comes at once, but the
# next quorum waits until the lighthouse has forgotten it. Six beats per timeout, so that
# one or two beats late on a saturated node are not a loss (tested under load).
HEARTBEAT_TIMEOUT_MS = 300
HEARTBEAT_INTERVAL = timedelta(milliseconds=50)
# How long the members of a quorum smaller than the last one wait for each other while they
# form its process group (its Gloo rendezvous), instead of the collective timeout. After a
# loss, a member that died after the lighthouse put it in the next quorum (two nodes lost
# a moment apart) never comes: the others give that quorum up after this, the step is
# redone, and the next quorum is without it (before, they waited the collective timeout:
# 30 s, 64 s seen). The members of such a quorum are replicas that were training a moment
# before, late by their scheduling delay only; one later than this (a starved process)
# fails the try for all, and each try after a failed one waits twice as long, so the same
# members, all still heard by the lighthouse, form it at a later try. A quorum that grows
# keeps the collective timeout: a joiner that has just started can be seconds late on a
# busy machine.
RENDEZVOUS_TIMEOUT = timedelta(seconds=0.5)


def make_manager(
    load: Any,
    save: Any,
    *,
    lighthouse: str,
    replica_id: str,
    timeout_s: float,
    host: str,
) -> Any:
    from elastic.addresses import bind_gloo_to

    bind_gloo_to(host)
    # Open before the Manager's first beat makes this replica heard (ExtraHeartbeats).
    beats = ExtraHeartbeats(lighthouse, HEARTBEAT_INTERVAL)
    beats.opened()
    try:
        return _beating_manager(load, save, beats, lighthouse, replica_id, timeout_s, host)
    except BaseException:
        beats.stop()
        raise


def _beating_manager(
    load: Any,
    save: Any,
    beats: ExtraHeartbeats,
    lighthouse: str,
    replica_id: str,
    timeout_s: float,
    host: str,
) -> Any:
    import torch
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager

    from elastic.train.process_group import bound_store

    timeout = timedelta(seconds=timeout_s)
    # The replica group's own store (a group of one): loopback only.
    store = bound_store("127.0.0.1", 1, timeout_s)
    pg = node_bound_gloo(host, timeout)
    with _manager_server_bound_to(host):
        manager = Manager(
            pg=pg,
            load_state_dict=load,
            state_dict=save,
            min_replica_size=1,
            use_async_quorum=False,  # the quorum is known before the step's samples are chosen
            timeout=timeout,
            # Longer than a collective can block: a survivor whose all-reduce failed first
            # asks for the next quorum while a peer may still sit in the same all-reduce
            # (Gloo's ring: the peer waits for data the first will not send) until the
            # collective timeout. A shorter quorum timeout turned that pause into a failed
            # attempt and a restart.
            quorum_timeout=timedelta(seconds=2 * timeout_s + 10),
            connect_timeout=timedelta(seconds=10),
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=host,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            checkpoint_transport=PGTransport(pg, timeout, torch.device("cpu")),
            init_sync=False,  # every replica builds the model from the same seed
        )
    manager._elastic_store = store  # kept alive with the manager
    manager._client = QuorumMembers(manager._client)
    _forget_failed_quorums(manager)
    _beat_over_more_connections(manager, store, beats)
    return manager


def _beat_over_more_connections(manager: Any, store: Any, beats: ExtraHeartbeats) -> None:
    """Heartbeats over connections besides the Manager's (elastic/in_place/heartbeats.py),
    for the id it registered; they stop when the Manager does: a replica that leaves must
    go silent."""
    from torchft.manager import REPLICA_ID_KEY

    beats.start(store.get(REPLICA_ID_KEY).decode())
    shutdown = manager.shutdown

    def shutdown_and_go_silent(wait: bool = True) -> None:
        beats.stop()
        shutdown(wait=wait)

    manager.shutdown = shutdown_and_go_silent


def _forget_failed_quorums(manager: Any) -> None:
    """torchft records a quorum as configured before it forms the quorum's process group,
    and reconfigures only for a new quorum id: after a failed rendezvous, a next quorum of
    the same members would train on no process group. The failed one is forgotten."""
    reconfigure = manager._reconfigure_pg

    def reconfigure_or_forget(communicator_id: int, handles: list[str]) -> None:
        try:
            reconfigure(communicator_id, handles)
        except BaseException:
            manager._quorum_id = -1
            raise

    manager._reconfigure_pg = reconfigure_or_forget


# Every socket a replica listens on is bound to its node's Ray address (loopback for the
# embedded default), as Ray's and the restart path's are (elastic/train/process_group.py).
# torchft 's Manager binds its server on every interface and its Gloo process group's
# rendezvous store on every interface under the machine's host name, with no option for
# either: the two shims below put those two on ``host``.


@contextlib.contextmanager
def _manager_server_bound_to(host: str) -> Iterator[None]:
    import torchft.manager as torchft_manager

    from elastic.addresses import url_host

    server = torchft_manager.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        return server(*args, bind=f"{url_host(host)}:{port}", **kwargs)

    torchft_manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft_manager.ManagerServer = server


def rendezvous_timeout(failed_tries: int, collective: timedelta) -> timedelta:
    """A shrunk quorum's rendezvous wait after ``failed_tries`` failed tries in a row:
    RENDEZVOUS_TIMEOUT, doubled for each, never more than the collective timeout."""
    return min(RENDEZVOUS_TIMEOUT * (1 << min(failed_tries, 16)), collective)


def node_bound_gloo(host: str, timeout: timedelta) -> Any:
    import torch
    from torchft.process_group import ProcessGroupGloo

    from elastic.addresses import url_host
    from elastic.train.process_group import bound_store

    class NodeBoundGloo(ProcessGroupGloo):  # type: ignore[misc]
        _formed_size = 0  # of the last quorum whose group formed
        _failed_tries = 0  # of forming a group, since the last that formed

        def get_reconfigure_handle(self) -> str:
            store: Any = self._rendezvous_store  # type: ignore[has-type]
            if store is None:
                store = bound_store(host, 1, timeout.total_seconds())
                self._rendezvous_store = store
            handle = json.loads(super().get_reconfigure_handle())
            handle["store"] = f"{url_host(host)}:{store.port}"
            return json.dumps(handle)

        def reconfigure(self, opts: Any) -> Any:
            """The quorum's group, formed within the rendezvous timeout when the quorum
            shrank (see RENDEZVOUS_TIMEOUT); its collectives keep the collective timeout."""
            size = len(opts.handles)
            if size < self._formed_size:
                self._timeout = rendezvous_timeout(self._failed_tries, timeout)
            try:
                work = super().reconfigure(opts)
            except BaseException:
                # A retry of the same members must not read this try's keys: every member
                # failed with it, and each one's next handle names a fresh store.
                self._rendezvous_store = None
                self._failed_tries += 1
                raise
            finally:
                self._timeout = timeout
            self._pg._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
            self._formed_size, self._failed_tries = size, 0
            return work

    return NodeBoundGloo(timeout=timeout)


# How long the replicas placed at an attempt's start wait for each other before the first
# quorum. Without the wait, the first one up trains alone and the others join it, healed,
# a few steps later (their processes start seconds apart here, importing torch).
START_TOGETHER_S = 60.0


def wait_for_starters(lighthouse: str, starting: int, timeout_s: float) -> int:
    """Until ``starting`` replicas heartbeat to the lighthouse (or ``timeout_s``: one that
    never comes is a joiner later); returns how many it saw."""
    from elastic.in_place.watchdog import LighthouseStatus

    deadline = time.monotonic() + timeout_s
    live = 0
    status = LighthouseStatus(lighthouse)
    try:
        while True:
            try:
                ages = status.ages()
                live = sum(age < HEARTBEAT_TIMEOUT_MS / 1000 for age in ages.values())
            except OSError:
                pass
            if live >= starting or time.monotonic() > deadline:
                return live
            time.sleep(0.05)
    finally:
        status.close()


# Threads: ``run`` trains; ``abort_step`` reaches it while a collective is in flight; each
# supervisor that watches the replica (the first, and each one re-created after a loss)
# waits in ``result``.
@ray.remote(max_restarts=0, max_concurrency=8)  # type: ignore[call-overload]
class Replica:
    def __init__(self) -> None:
        self.ctx: Any = None
        self.ended = threading.Event()
        self.outcome: str | BaseException | None = None
        # Its node's raylet gone, it ends at once (not at Ray's check a second later).
        die_with_parent()

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
        if self.ctx is None:
            return False
        return bool(self.ctx.abort.request(dropped_for_s))

    def leave(self, save: bool) -> None:
        """Its node is draining: leave the quorum at the next step boundary (``save``: no
        other replica stays, so first checkpoint that step)."""
        if self.ctx is not None:
            self.ctx.save_on_leave = save
            self.ctx.leaving.set()

    def expect_drain(self) -> None:
        """Peers are leaving a draining node: the next shrink of the quorum is a drain."""
        if self.ctx is not None:
            self.ctx.timeline.expect_drain()

    def run(self, *args: Any) -> None:
        """Train (the arguments are ``_run``'s); how it ended is for ``result``."""
        try:
            self.outcome = self._run(*args)
        except BaseException as e:
            self.outcome = e
        finally:
            self.ended.set()

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

        def start_together() -> None:
            wait_for_starters(lighthouse, starting, START_TOGETHER_S)

        ctx = self.ctx = InPlaceContext(config, worker, factory, replica, must_heal, start_together)
        try:
            with forward_output(send):
                resolve(train_loop)(config, ctx)
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
