"""Forming a job's torch process group with its rendezvous store bound to the node's own
address.

torch's ``TCPStore`` server listens on every interface whatever host it is given, so a
process group formed the stock way (``init_process_group("tcp://addr:port")``) leaves an
unauthenticated key-value store open to the whole network on rank 0's node, even when Ray
itself is kept on loopback. Here rank 0 binds the listening socket to Ray's address for the
node (loopback for the embedded default) and hands it to the store; the other ranks connect
to it, and every rank joins the group through that store. Each attempt opens a store of its
own (a warm worker outlives its attempts: see ``elastic/restart/worker.py``).
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic.train.group_sockets import GroupSockets, listening_since, own_sockets

# Where each rank tells the attempt's store which ports it listens on for the group.
PORTS_KEY = "elastic/group-ports"

# How often a collective waiting on its peers looks whether its attempt was given up.
ABANDON_POLL_S = 0.05


class AttemptAbandoned(Exception):
    """The supervisor gave up on this worker's attempt (it failed elsewhere): a collective
    still waiting on a peer was left rather than waited out."""


def all_reduce(tensor: torch.Tensor, abandoned: threading.Event, group: Any = None) -> None:
    """``dist.all_reduce`` in place, given up (:class:`AttemptAbandoned`) once ``abandoned``
    is set. A Gloo peer that left a failed attempt keeps its sockets open for as long as
    anything in its process holds its group, and DDP's logger holds it in C++ for the
    process's life: a peer waiting on it would wait out the collective timeout. Tensors on
    an accelerator go the plain way, since NCCL's futures complete on the stream."""
    start_all_reduce(tensor, abandoned, group).wait()


class PendingAllReduce:
    """An all-reduce under way: :meth:`wait` until it is done, or the attempt abandoned."""

    def __init__(self, work: Any, abandoned: threading.Event) -> None:
        self.work, self.abandoned = work, abandoned
        self.done = threading.Event()
        if work is not None:
            work.get_future().add_done_callback(lambda _: self.done.set())

    def wait(self) -> None:
        if self.work is None:
            return
        while not self.done.wait(ABANDON_POLL_S):
            if self.abandoned.is_set():
                raise AttemptAbandoned(
                    "the attempt failed elsewhere: a collective was left waiting"
                )
        self.work.wait()  # raises the collective's own error, if it failed


def start_all_reduce(
    tensor: torch.Tensor, abandoned: threading.Event, group: Any = None
) -> PendingAllReduce:
    """:func:`all_reduce` started now and waited for later, so that it overlaps other work
    (a step's loss, summed across workers while its backward pass runs). Collectives run in
    the order they are started, which must be the same on every rank."""
    if abandoned.is_set():
        raise AttemptAbandoned("the attempt failed elsewhere")
    if tensor.device.type != "cpu":
        dist.all_reduce(tensor, group=group)
        return PendingAllReduce(None, abandoned)
    return PendingAllReduce(dist.all_reduce(tensor, group=group, async_op=True), abandoned)


def bound_store(host: str, world_size: int, timeout_s: float, port: int = 0) -> Any:
    """A master ``TCPStore`` listening on ``host`` only, on ``port`` (0: one free now). The
    store owns its listening socket and closes it when it is destroyed: nothing here may
    close that descriptor too, or a second close could hit whatever socket reused its number
    meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, port))
    listener.listen(max(128, world_size))
    port = int(listener.getsockname()[1])
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


# How long one try to reach the attempt's store may wait for a handshake, and the pause
# after a refused one, when the join can be given up: the store's own client retries for its
# whole timeout, with no way in.
STORE_CONNECT_TRY_S = 0.5
STORE_RETRY_S = 0.05


def _client_store(
    host: str, port: int, world_size: int, timeout_s: float, abandoned: threading.Event | None
) -> Any:
    """A client of the attempt's store. With ``abandoned``, the store is first reached by a
    plain connection, tried again until one is accepted, the attempt is given up
    (:class:`AttemptAbandoned`) or ``timeout_s`` passed: rank 0 may have died before it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if abandoned is not None:
        deadline = time.monotonic() + timeout_s
        while True:
            if abandoned.is_set():
                raise AttemptAbandoned("the attempt failed elsewhere while this worker joined")
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"the attempt's store at {host}:{port} did not answer")
            try:
                socket.create_connection((host, port), min(STORE_CONNECT_TRY_S, left_s)).close()
                break
            except OSError:
                time.sleep(STORE_RETRY_S)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def join_process_group(
    backend: str,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    master_store: Any = None,
    abandoned: threading.Event | None = None,
) -> GroupSockets:
    """Join the attempt's process group: rank 0 through the store it opened
    (``master_store``), the others as clients of it. Returns the group's sockets in this
    process, to shut when the attempt fails (``elastic/train/group_sockets.py``). With
    ``abandoned``, a client gives up reaching the store once it is set (see
    :class:`~elastic.train.group_sockets.Joining` for the rest of the join)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        assert master_store is not None, "rank 0 hosts the store"
        store = master_store
    else:
        store = _client_store(host, port, world_size, timeout_s, abandoned)
    before = set(own_sockets())
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    ours = listening_since(before)
    store.set(f"{PORTS_KEY}/{rank}", json.dumps(sorted(ours)))
    group = {(host, port)}
    for other in range(world_size):
        group |= {(ip, p) for ip, p in json.loads(store.get(f"{PORTS_KEY}/{other}"))}
    return GroupSockets(frozenset(ours), frozenset(group))
