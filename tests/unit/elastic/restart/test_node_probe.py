"""The node probe's handshake, with real sockets on loopback: a port someone listens on is
up, one no one listens on any more is gone; a node missing from Ray's list is gone."""

from __future__ import annotations

import asyncio
import socket

from elastic.restart.node_probe import NodeAnswer, NodeProbe, handshake


def test_a_listening_port_is_up_and_a_closed_one_is_gone() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = listening.getsockname()[1]
        with socket.socket() as closed:  # bound, then let go: nothing listens there
            closed.bind(("127.0.0.1", 0))
            gone = closed.getsockname()[1]

        async def body() -> tuple[NodeAnswer, NodeAnswer]:
            return await handshake("127.0.0.1", up), await handshake("127.0.0.1", gone)

        assert asyncio.run(body()) == (NodeAnswer.UP, NodeAnswer.GONE)


def test_the_probe_looks_nodes_up_once_and_a_node_ray_does_not_list_is_gone() -> None:
    lookups: list[int] = []

    def addresses() -> dict[str, tuple[str, int]]:
        lookups.append(1)
        return {"n0": ("10.0.0.1", 6001)}

    async def shake(host: str, port: int) -> NodeAnswer:
        return NodeAnswer.UP if (host, port) == ("10.0.0.1", 6001) else NodeAnswer.SILENT

    async def body() -> list[NodeAnswer]:
        probe = NodeProbe(addresses, shake)
        return [await probe.ask("n0"), await probe.ask("n0"), await probe.ask("n9")]

    assert asyncio.run(body()) == [NodeAnswer.UP, NodeAnswer.UP, NodeAnswer.GONE]
    assert len(lookups) == 2  # once for n0, once more for the unknown n9
