"""The TCP sockets of one attempt's process group in a worker's process, found from the
kernel's socket tables, so that leaving a failed attempt can shut them.

A Gloo group's sockets stay open for as long as anything in the process holds the group,
and DDP's logger holds it in C++ for the process's life. A warm worker outlives its
attempts, so a peer waiting on it in a collective (DDP's gradient all-reduce as often as
a small one) would wait out the collective timeout. Shutting the sockets (not closing the
descriptors, which Gloo still owns) ends such a wait at once on both sides.

The group's sockets are told apart from Ray's by their ports: each rank publishes in the
attempt's store the ports it listens on for the group, and a socket belongs to the group
when it was accepted on one of those or connected to one."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP state for a listening socket
WILDCARDS = {"0.0.0.0", "::"}
# Gloo's handshake: the side of a pair that connects first writes the sequence number the
# other side's pair waits for, a native 8-byte signed integer (``sequence_number_t`` in
# gloo/transport/tcp/listener.cc). A fresh group's pair for peer ``i`` waits for ``i``.
GLOO_SEQUENCE = struct.Struct("=q")
# How long handing a waiting pair its connection may take: the listener is this process's.
HAND_OVER_S = 1.0


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]
    listening: bool


def _address(field: str) -> tuple[str, int]:
    """``0100007F:1F90`` (IPv4) or 32 hex digits and a port (IPv6), as the kernel writes
    them: each 32-bit word of the address in the host's byte order (little-endian here)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(hex_port, 16)


def parse_tcp_table(text: str) -> list[TcpSocket]:
    """The rows of ``/proc/net/tcp`` or ``tcp6``."""
    sockets = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        sockets.append(
            TcpSocket(
                inode=int(fields[9]),
                local=_address(fields[1]),
                remote=_address(fields[2]),
                listening=fields[3] == LISTEN,
            )
        )
    return sockets


def tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket of this process's network namespace."""
    found: list[TcpSocket] = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            found += parse_tcp_table(Path(f"/proc/self/net/{table}").read_text())
    return found


def own_sockets() -> dict[int, int]:
    """This process's sockets: inode -> one of its descriptors."""
    owned: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(entry.path)
                if target.startswith("socket:["):
                    owned[int(target[8:-1])] = int(entry.name)
    return owned


def listening_since(before: set[int]) -> set[tuple[str, int]]:
    """Where this process listens on sockets it opened since ``before`` (inodes)."""
    new = set(own_sockets()) - before
    return {s.local for s in tcp_sockets() if s.listening and s.inode in new}


def belongs(sock: TcpSocket, ours: set[tuple[str, int]], group: set[tuple[str, int]]) -> bool:
    """A connection accepted on one of this rank's group ports (``ours``), or made to one
    of any rank's (``group``, the store's included)."""
    if sock.listening:
        return False
    if any(sock.local[1] == port for _, port in ours):
        return True
    return any(
        sock.remote[1] == port and (ip in WILDCARDS or ip == sock.remote[0]) for ip, port in group
    )


@dataclass(frozen=True)
class GroupSockets:
    """One attempt's process group, as this rank's sockets see it."""

    ours: frozenset[tuple[str, int]]  # where this rank listens for the group
    group: frozenset[tuple[str, int]]  # where every rank listens, and the store

    def shut(self) -> int:
        """Shut every connection of the group in this process; returns how many."""
        owned = own_sockets()
        shut = 0
        for sock in tcp_sockets():
            fd = owned.get(sock.inode)
            if fd is None or not belongs(sock, set(self.ours), set(self.group)):
                continue
            with contextlib.suppress(OSError):
                # A duplicate of the descriptor: the socket is shut for its owner too, and
                # the owner's descriptor stays valid (closing it under Gloo would not be).
                dup = socket.socket(fileno=os.dup(fd))
                try:
                    dup.shutdown(socket.SHUT_RDWR)
                    shut += 1
                finally:
                    dup.close()
        return shut


def hand_over(listeners: Iterable[tuple[str, int]], peers: Iterable[int]) -> int:
    """Connect to each of this process's Gloo ``listeners`` once per peer, announce that
    peer's sequence number, and leave at once; returns how many were handed over.

    Of the two sides of a Gloo pair, the one with the lower address waits for the other to
    connect, with no socket of its own yet: shutting sockets does not reach it, and a peer
    that died before it connected leaves it waiting five times the group's timeout. Handed
    a connection that ends as it starts, the pair is connected and its first use fails, so
    the formation ends at once. A number no pair waits for is kept by the listener unused
    until the group goes."""
    handed = 0
    for ip, port in listeners:
        for peer in peers:
            with contextlib.suppress(OSError):
                host = "127.0.0.1" if ip == "0.0.0.0" else "::1" if ip == "::" else ip
                with socket.create_connection((host, port), HAND_OVER_S) as conn:
                    conn.sendall(GLOO_SEQUENCE.pack(peer))
                handed += 1
    return handed


class Joining:
    """A join under way in this process, as far as it got: what :meth:`shut` closes so that
    a join waiting on a peer that died before it joined (which sends nothing, not even a
    reset) is given up at once rather than at the collective timeout."""

    def __init__(self, rank: int, world_size: int, host: str, port: int) -> None:
        self.rank, self.world_size, self.store = rank, world_size, (host, port)
        self.before = set(own_sockets())

    def sockets(self) -> GroupSockets:
        """Connections to the store (and, on rank 0, those it accepted), and those on the
        ports Gloo has listened on since the join began."""
        ours = listening_since(self.before) | ({self.store} if self.rank == 0 else set())
        return GroupSockets(frozenset(ours), frozenset({self.store}))

    def shut(self) -> int:
        """Shut the join's connections, then hand the pairs still waiting for a peer to
        connect one that ends at once (:func:`hand_over`): the store is shut first, so a
        formation that gets past its pairs fails at the store."""
        sockets = self.sockets()
        shut = sockets.shut()
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        return shut + hand_over(sockets.ours - {self.store}, peers)
