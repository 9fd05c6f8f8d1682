"""Is a worker's node still there? Asked of the node's kernel, not of its processes.

A worker's ping can go unanswered for a second or more on a busy machine while its process
is alive, so a silent ping alone does not prove its node lost. The node's raylet listens on a
TCP port, and a node's kernel completes a TCP handshake however starved its processes are:
a handshake the node refuses means its raylet is gone (the machine's processes were lost), and
one nobody answers means the node is cut off or powered off. Only a frozen node still
completes it; its workers are counted dead later, when their runs do not end in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import ray

# How long a handshake may take before the node counts as not answering: across a data
# centre it takes a millisecond, and the kernel answers even when every process is starved.
HANDSHAKE_S = 1.0


class NodeAnswer(Enum):
    UP = "up"  # the handshake completed: the node's kernel and its raylet's socket are there
    GONE = "gone"  # refused, or no route: the raylet's process is gone
    SILENT = "silent"  # no answer within HANDSHAKE_S: cut off, or powered off


# Errors that say, at once, that nothing listens there any more.
_GONE = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET}


async def handshake(host: str, port: int, timeout_s: float = HANDSHAKE_S) -> NodeAnswer:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except TimeoutError:
        return NodeAnswer.SILENT
    except OSError as e:
        return NodeAnswer.GONE if e.errno in _GONE else NodeAnswer.SILENT
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return NodeAnswer.UP


def _raylet_addresses() -> dict[str, tuple[str, int]]:
    nodes: list[dict[str, Any]] = ray.nodes()
    return {
        str(n["NodeID"]): (str(n["NodeManagerAddress"]), int(n["NodeManagerPort"]))
        for n in nodes
        if n.get("NodeManagerAddress") and n.get("NodeManagerPort")
    }


class NodeProbe:
    """Handshakes with nodes' raylets, by Ray node id (whose address never changes: a node
    that comes back is a new node)."""

    def __init__(
        self,
        addresses: Callable[[], dict[str, tuple[str, int]]] = _raylet_addresses,
        shake: Callable[[str, int], Awaitable[NodeAnswer]] = handshake,
    ) -> None:
        self._addresses = addresses
        self._shake = shake
        self._known: dict[str, tuple[str, int]] = {}

    async def ask(self, node: str) -> NodeAnswer:
        if node not in self._known:
            self._known.update(await asyncio.to_thread(self._addresses))
        if node not in self._known:  # Ray's membership no longer lists it at all
            return NodeAnswer.GONE
        host, port = self._known[node]
        return await self._shake(host, port)
