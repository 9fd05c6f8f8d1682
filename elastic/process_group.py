"""Forming a job's torch process group with its rendezvous store bound to the node's own
address.

torch's ``TCPStore`` server listens on every interface whatever host it is given, so a
process group formed the stock way (``init_process_group("tcp://addr:port")``) leaves an
unauthenticated key-value store open to the whole network on rank 0's node, even when Ray
itself is kept on loopback. Here rank 0 binds the listening socket to Ray's address for the
node (loopback for the embedded default) and hands it to the store; the other ranks connect
to it, and every rank joins the group through that store. Each attempt opens a store of its
own (a warm worker outlives its attempts: see ``elastic/warm_pool.py``).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch.distributed as dist


def bound_store(host: str, world_size: int, timeout_s: float) -> tuple[Any, socket.socket]:
    """A master ``TCPStore`` listening on ``host`` only, and the socket under it (which
    must live as long as the store)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(max(128, world_size))
    store = dist.TCPStore(
        host,
        int(listener.getsockname()[1]),
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    return store, listener


def join_process_group(
    backend: str,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    master_store: Any = None,
) -> None:
    """Join the attempt's process group: rank 0 through the store it opened
    (``master_store``), the others as clients of it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        assert master_store is not None, "rank 0 hosts the store"
        store = master_store
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )
