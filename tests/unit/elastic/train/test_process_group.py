"""A worker's collectives and its join, given up when its attempt failed: two real Gloo
groups of one world of 2, in two threads of this process; joins of a world of 3, each in
its own process; and the sockets a group is found by."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.train.group_sockets import (
    GroupSockets,
    TcpSocket,
    belongs,
    listening_since,
    own_sockets,
    parse_tcp_table,
)
from elastic.train.process_group import (
    ABANDON_POLL_S,
    STORE_CONNECT_TRY_S,
    STORE_RETRY_S,
    AttemptAbandoned,
    all_reduce,
)


def two_ranks() -> dict[int, Any]:
    """Rank -> its Gloo group, of one world of 2 in this process."""
    store = dist.HashStore()
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:  # each rank's group connects to the other's: both at once
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20))

    joining = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join()
    return groups


@pytest.fixture
def world_of_2() -> Iterator[dict[int, Any]]:
    yield two_ranks()


def test_a_collective_whose_peer_never_comes_is_given_up_once_abandoned(
    world_of_2: dict[int, Any],
) -> None:
    """A peer that failed and left keeps its sockets open: the wait on it ends only by the
    supervisor's word, and at once."""
    abandoned = threading.Event()
    waiting = torch.tensor([1.0, 2.0], dtype=torch.float64)
    threading.Timer(0.3, abandoned.set).start()
    began = time.monotonic()
    with pytest.raises(AttemptAbandoned):
        all_reduce(waiting, abandoned, world_of_2[0])
    assert 0.3 <= time.monotonic() - began < 0.3 + 4 * ABANDON_POLL_S
    with pytest.raises(AttemptAbandoned):  # later collectives of the attempt go at once
        all_reduce(waiting, abandoned, world_of_2[0])
    # The peer's half arrives after all: the op left behind completes, and nothing is
    # left running when the groups go.
    all_reduce(torch.tensor([10.0, 20.0], dtype=torch.float64), threading.Event(), world_of_2[1])


def test_a_collective_both_ranks_join_sums_as_dist_all_reduce_does(
    world_of_2: dict[int, Any],
) -> None:
    tensors = {
        0: torch.tensor([1.0, 2.0], dtype=torch.float64),
        1: torch.tensor([0.5, 0.25], dtype=torch.float64),
    }
    other = threading.Thread(target=all_reduce, args=(tensors[1], threading.Event(), world_of_2[1]))
    other.start()
    all_reduce(tensors[0], threading.Event(), world_of_2[0])
    other.join()
    expected = torch.tensor([1.5, 2.25], dtype=torch.float64)
    assert torch.equal(tensors[0], expected) and torch.equal(tensors[1], expected)


def test_shutting_a_group_s_sockets_ends_a_peer_s_wait_and_leaves_other_sockets_alone() -> None:
    """A Gloo group built whole in this process (both ranks): shutting its sockets makes the
    pending collective fail at once, instead of at the 20 s timeout, while a TCP connection
    that is not the group's (as Ray's own are) still carries data."""
    before = set(own_sockets())
    groups = two_ranks()
    listening = listening_since(before)
    assert listening, "Gloo listens for its pairs"
    bystander = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(bystander.getsockname())
    served, _ = bystander.accept()

    work = groups[0].allreduce([torch.ones(3, dtype=torch.float64)])  # rank 1 never joins
    began = time.monotonic()
    assert GroupSockets(frozenset(listening), frozenset(listening)).shut() >= 1
    with pytest.raises(RuntimeError):
        work.wait()
    assert time.monotonic() - began < 2.0
    client.sendall(b"still here")
    assert served.recv(16) == b"still here"
    for sock in (client, served, bystander):
        sock.close()


def test_the_kernel_s_socket_table_is_read_with_its_byte_order() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
        "  timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000"
        "     0        0 4026 1 0000000008b5a322 100 0 0 10 0\n"
        "   1: 0296A80A:C350 1196A80A:1F90 01 00000000:00000000 00:00000000 00000000"
        "     0        0 5120 1 0000000008b5a322 100 0 0 10 0\n"
    )
    listener, link = parse_tcp_table(table)
    assert listener == TcpSocket(4026, ("127.0.0.1", 8080), ("0.0.0.0", 0), listening=True)
    assert link == TcpSocket(5120, ("10.168.150.2", 50000), ("10.168.150.17", 8080), False)
    v6 = (
        "header\n"
        "   0: 0000000000000000FFFF00000100007F:1F90 00000000000000000000000000000000:0000 0A"
        " 00000000:00000000 00:00000000 00000000     0        0 77 1 0 100 0 0 10 0\n"
    )
    (mapped,) = parse_tcp_table(v6)
    assert mapped.local == ("127.0.0.1", 8080) and mapped.listening


def test_a_connection_belongs_to_the_group_by_its_ports() -> None:
    ours = {("10.0.0.2", 40000)}
    group = ours | {("10.0.0.3", 40001), ("10.0.0.2", 29500)}  # a peer, and the store
    accepted = TcpSocket(1, ("10.0.0.2", 40000), ("10.0.0.3", 51000), False)
    to_peer = TcpSocket(2, ("10.0.0.2", 52000), ("10.0.0.3", 40001), False)
    to_store = TcpSocket(3, ("10.0.0.2", 52001), ("10.0.0.2", 29500), False)
    to_ray = TcpSocket(4, ("10.0.0.2", 52002), ("10.0.0.9", 40001), False)  # same port, other host
    listener = TcpSocket(5, ("10.0.0.2", 40000), ("0.0.0.0", 0), True)
    assert [belongs(s, ours, group) for s in (accepted, to_peer, to_store, to_ray, listener)] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert belongs(to_ray, ours, {("0.0.0.0", 40001)})  # a peer listening on every address


# A join of one world of 3 in its own process (a group is the process's), given up as the
# worker's ``abandon`` does (the flag set, the join's sockets shut): GIVE_UP_S after it began,
# or, with 0, when a line comes on its stdin. It prints how it ended, and how long after the
# give-up.
JOIN = """
import json, sys, threading, time
from elastic.train.group_sockets import Joining
from elastic.train.process_group import bound_store, join_process_group
rank, port, give_up_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
store = bound_store("127.0.0.1", 3, 60.0, port=port) if rank == 0 else None
abandoned, joining = threading.Event(), Joining(rank, 3, "127.0.0.1", port)
given_up = []
def give_up():
    if give_up_s == 0:
        sys.stdin.readline()
    else:
        time.sleep(give_up_s)
    given_up.append(time.monotonic())
    abandoned.set()
    joining.shut()
threading.Thread(target=give_up, daemon=True).start()
print("joining", flush=True)
try:
    join_process_group("gloo", rank, 3, "127.0.0.1", port, 60.0, store, abandoned)
    ended = "joined"
except Exception as e:
    ended = type(e).__name__
print(json.dumps([ended, time.monotonic() - given_up[0] if given_up else None]), flush=True)
"""


def joiner(rank: int, port: int, give_up_s: float) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", JOIN, str(rank), str(port), str(give_up_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "joining"
    return process


def ended(process: subprocess.Popen[str], give_up: bool = False) -> tuple[str, float]:
    """How the join ended, and how long after it was given up."""
    out, _ = process.communicate(input="give up\n" if give_up else None, timeout=60)
    how, late_s = json.loads(out.splitlines()[-1])
    assert late_s is not None, f"the join ended by itself: {how}"
    return how, late_s


def test_a_join_waiting_on_a_peer_that_never_comes_is_given_up_at_once() -> None:
    """Ranks 0 and 1 of a world of 3 wait in the join for rank 2, which died before it
    joined and so sends nothing: shutting what each one's join has opened ends its wait at
    once, not at the 60 s timeout. Rank 1 gives up first, and rank 0 (the store's host)
    still waits until it gives up too."""
    port = free_port()
    first = joiner(0, port, give_up_s=0)
    how, late_s = ended(joiner(1, port, give_up_s=2.0))
    assert how != "joined" and late_s < 1.0
    assert first.poll() is None  # rank 1 leaving is not rank 2 coming
    how, late_s = ended(first, give_up=True)
    assert how != "joined" and late_s < 1.0


def test_a_store_that_never_answers_is_given_up_within_a_try() -> None:
    """Rank 0 died before anyone reached its store: a client's tries to connect end once
    the attempt is given up, within one try's length."""
    how, late_s = ended(joiner(1, free_port(), give_up_s=0.5))
    assert how == "AttemptAbandoned" and late_s < STORE_CONNECT_TRY_S + STORE_RETRY_S + 0.3


# A rank of that world of 3 whose Gloo device is on another address, 127.0.0.2: in each of
# its pairs it is the side that connects (the higher address), and the others' pairs wait
# for it. It prints "published" once its address is in the store, where it then waits for
# rank 1's, having connected to no one yet.
PUBLISHES_THEN_DIES = """
import datetime, sys, threading, time
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from elastic.train.group_sockets import listening_since, own_sockets
Gloo = dist.ProcessGroupGloo

def on_another_address(store, rank, size, timeout, enable_reconfigure=False):
    options = Gloo._Options()
    options._timeout = timeout
    options._devices = [Gloo.create_device(hostname="127.0.0.2")]
    return Gloo(store, rank, size, options)

def published(before):
    while not listening_since(before):
        time.sleep(0.01)
    time.sleep(0.5)  # its address goes into the store as its listener opens
    print("published", flush=True)

c10d.ProcessGroupGloo = on_another_address
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 3, timeout=datetime.timedelta(seconds=60))
threading.Thread(target=published, args=(set(own_sockets()),), daemon=True).start()
dist.init_process_group("gloo", store=store, rank=2, world_size=3)
"""


def test_a_join_whose_pair_waits_for_a_peer_that_died_before_connecting_is_given_up() -> None:
    """Rank 2 put its address in the store and died before it connected to anyone. Rank 0
    and rank 1, on a lower address, each wait in a pair for rank 2 to connect: no socket of
    theirs leads to it, and Gloo would wait five times the 60 s timeout. Giving the join up
    ends it at once on both."""
    port = free_port()
    first = joiner(0, port, give_up_s=0)
    dead = subprocess.Popen(
        [sys.executable, "-c", PUBLISHES_THEN_DIES, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert dead.stdout is not None and dead.stdout.readline().strip() == "published"
    finally:
        dead.kill()
        dead.wait()
    second = joiner(1, port, give_up_s=2.0)
    how, late_s = ended(second)
    assert how != "joined" and late_s < 1.0, (how, late_s)
    how, late_s = ended(first, give_up=True)
    assert how != "joined" and late_s < 1.0, (how, late_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
