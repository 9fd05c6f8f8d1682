"""The addresses a node's processes are reached at by processes on other nodes.

Everything that listens for peers (the lighthouse, torchft's manager and stores, Gloo, the
rendezvous stores) binds to the node's Ray address and advertises that same address, never
the machine's host name: on Kubernetes other pods cannot resolve a pod's name, and on a
Debian host the name resolves to 127.0.1.1. No torch here: the supervisor imports it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger(__name__)

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address`` (IPv4 or IPv6),
    or None when none does."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        with_v6 = Path("/proc/net/if_inet6")
        if not with_v6.is_file():
            return None
        for line in with_v6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # an interface with no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == str(ip):
                return name
    return None


def bind_gloo_to(address: str) -> str | None:
    """Make every Gloo process group this process forms from now on (torch's, torchft's)
    listen on ``address``, the node's Ray address, and tell its peers that address.

    Left to itself, Gloo uses the address the machine's host name resolves to, or loopback
    when it resolves to none. On a Debian host (the name is 127.0.1.1) or a Kubernetes pod
    (other pods cannot resolve its name) its peers on other nodes are then told a loopback
    address and cannot connect. Gloo takes the interface from ``GLOO_SOCKET_IFNAME``; an
    administrator's own setting is kept. Returns the interface used (None: Gloo's default)."""
    chosen = os.environ.get(GLOO_INTERFACE_ENV)
    if chosen:
        return chosen
    name = interface_of(address)
    if name is None:
        log.warning(
            "no network interface holds this node's address %s: Gloo picks its own "
            "(set %s to the interface peers reach this node on)",
            address,
            GLOO_INTERFACE_ENV,
        )
        return None
    os.environ[GLOO_INTERFACE_ENV] = name
    return name


def url_host(address: str) -> str:
    """``address`` as the host part of a URL or a ``host:port`` (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address
