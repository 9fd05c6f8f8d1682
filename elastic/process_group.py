"""Forming a job's torch process group with its rendezvous store bound to the node's own
address.

torch's ``TCPStore`` server listens on every interface whatever host it is given, so a
process group formed the stock way (``init_process_group("tcp://addr:port")``, as Ray
Train does) leaves an unauthenticated key-value store open to the whole network on rank 0's
node, even when Ray itself is kept on loopback. Here rank 0 binds the listening socket to
Ray's address for the node (loopback for the embedded default) and hands it to the store;
the other ranks connect to it, and every rank joins the group through that store.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import ray
import torch.distributed as dist
from ray.train.backend import BackendConfig
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

# Rank 0's store (and the socket under it) live as long as the worker process.
_held: dict[str, Any] = {}


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


def open_master_store(world_size: int, timeout_s: float) -> tuple[str, int]:
    """On rank 0: a rendezvous store listening on this node's Ray address only."""
    host = ray.util.get_node_ip_address()
    store, listener = bound_store(host, world_size, timeout_s)
    _held.update(listener=listener, store=store)
    return host, int(store.port)


def join_process_group(
    backend: str, rank: int, world_size: int, host: str, port: int, timeout_s: float
) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = _held["store"]
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


class _NodeBoundBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TorchConfig)
        backend = backend_config.backend or "gloo"
        size = len(worker_group)
        timeout_s = float(backend_config.timeout_s)
        host, port = worker_group.execute_single(0, open_master_store, size, timeout_s)
        from ray.train.torch.config import _set_torch_distributed_env_vars

        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank, join_process_group, backend, rank, size, host, port, timeout_s
                )
                for rank in range(size)
            ]
        )


class NodeBoundTorchConfig(TorchConfig):
    """Ray Train's ``TorchConfig`` whose process group's store listens on the node's Ray
    address only."""

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _NodeBoundBackend
