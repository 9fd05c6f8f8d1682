"""The in-place attempts' lighthouses, held by one detached actor per cluster on the head
node.

A lighthouse in the supervisor's process died with it, and every replica's quorum with it:
the job restarted from its checkpoint. Held here, it outlives the supervisor, so the
replicas train on while the service re-creates the supervisor, and the new one adopts the
attempt (elastic/in_place/runner.py). One process holds every job's lighthouse (each a Rust
server with a few threads): one process per job would cost every in-place job a Ray worker's
memory. The head node holds it, as it holds the supervisors: it outlives the worker nodes.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import urllib.parse
from dataclasses import dataclass, replace
from typing import Any

import ray

from elastic.addresses import url_host
from elastic.cluster.capacity import one_per_cluster

HOST_NAME = "etrain-lighthouses"
JOIN_TIMEOUT_MS = 1000
QUORUM_TICK_MS = 20

_TORCHFT_EXTENSION = "torchft._torchft"


def lighthouse_server_class() -> Any:
    """torchft's ``LighthouseServer``, loaded from torchft's compiled extension without
    running torchft's package ``__init__``, which imports torch: about 1.4 CPU-seconds and
    560 MB of memory for a server that needs neither (``torchft.coordination`` re-exports it
    from that extension). Where the extension is not where torchft keeps it, the package is
    imported after all."""
    module = sys.modules.get(_TORCHFT_EXTENSION)
    if module is None:
        package = importlib.util.find_spec("torchft")  # finds the package, does not run it
        locations = package.submodule_search_locations if package else None
        spec = importlib.machinery.PathFinder.find_spec(_TORCHFT_EXTENSION, locations)
        if spec is None or spec.loader is None:
            from torchft.coordination import LighthouseServer

            return LighthouseServer
        module = importlib.util.module_from_spec(spec)
        # Registered first: torchft imported later in this process reuses it (an extension
        # module is initialised once per process).
        sys.modules[_TORCHFT_EXTENSION] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_TORCHFT_EXTENSION]  # no half-initialised module for later imports
            raise
    return module.LighthouseServer


def reachable_url(advertised: str, host: str) -> str:
    """The lighthouse's URL with ``host``, the address it is bound to, for the replicas.
    torchft advertises ``http://<host name>:<port>``, a name other nodes may not resolve, or
    resolve to loopback (a Kubernetes pod's name, Debian's 127.0.1.1)."""
    port = urllib.parse.urlsplit(advertised).port
    if port is None:
        raise ValueError(f"the lighthouse advertised no port: {advertised!r}")
    return f"http://{url_host(host)}:{port}"


@dataclass(frozen=True)
class Lighthouse:
    """One attempt's lighthouse, and what a supervisor that adopts the attempt must know."""

    url: str
    attempt: int
    starting: int  # the replicas placed at the attempt's start
    limit: int  # how many replicas the attempt keeps placed (the scheduler's size)


@ray.remote(num_cpus=0, max_restarts=0)
class LighthouseHost:
    """Every running in-place attempt's lighthouse, by job (one attempt at a time each)."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[Any, Lighthouse]] = {}

    def open(
        self, job: str, attempt: int, starting: int, limit: int, heartbeat_timeout_ms: int
    ) -> Lighthouse:
        """A new lighthouse for the job's attempt, bound to this node's Ray address; the
        job's earlier one, if any, is shut."""
        self.close(job)
        host = ray.util.get_node_ip_address()
        server = lighthouse_server_class()(
            bind=f"{url_host(host)}:0",
            min_replicas=1,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            # A quorum waiting on a lost replica forms at the first tick after the
            # lighthouse forgets it: torchft's default tick (100 ms) would add to the pause.
            quorum_tick_ms=QUORUM_TICK_MS,
        )
        held = Lighthouse(reachable_url(server.address(), host), attempt, starting, limit)
        self.held[job] = (server, held)
        return held

    def find(self, job: str) -> Lighthouse | None:
        entry = self.held.get(job)
        return entry[1] if entry else None

    def set_limit(self, job: str, attempt: int, limit: int) -> None:
        entry = self.held.get(job)
        if entry is not None and entry[1].attempt == attempt:
            self.held[job] = (entry[0], replace(entry[1], limit=limit))

    def close(self, job: str, attempt: int | None = None) -> None:
        """Shut the job's lighthouse (only attempt ``attempt``'s, when given)."""
        entry = self.held.get(job)
        if entry is None or (attempt is not None and entry[1].attempt != attempt):
            return
        del self.held[job]
        entry[0].shutdown()


def lighthouse_host(namespace: str) -> Any:
    """The cluster's lighthouse host, started if it is not running."""
    options = one_per_cluster(HOST_NAME, namespace)
    return LighthouseHost.options(**options).remote()  # type: ignore[attr-defined]
