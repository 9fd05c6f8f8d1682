"""The supervisor's watch on its replicas' heartbeats, as its lighthouse sees them.

The lighthouse drops a replica from the next quorum when its heartbeats stop for
``HEARTBEAT_TIMEOUT_MS``; the replicas in a collective with it learn nothing from that
(see elastic/in_place/abort.py). The lighthouse shows its view only on its status page
(``/status``: ``<replica id>: seen <seconds>s ago`` per replica), read here from the
supervisor's own process every ``POLL_S``.
"""

from __future__ import annotations

import http.client
import re
import urllib.parse
from collections.abc import Collection, Iterable

POLL_S = 0.1

_SEEN = re.compile(r"^\s*(\S+): seen ([0-9.]+(?:e-?\d+)?)(ns|µs|us|ms|s) ago", re.MULTILINE)
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def heartbeat_ages(status_page: str) -> dict[str, float]:
    """replica id -> seconds since the lighthouse last heard from it. torchft's Manager
    appends ``:<uuid>`` to the replica id it is given; the key here is the id given."""
    ages: dict[str, float] = {}
    for m in _SEEN.finditer(status_page):
        rid, age = m[1].split(":")[0], float(m[2]) * _UNIT_S[m[3]]
        ages[rid] = min(age, ages.get(rid, age))
    return ages


# What a kept-alive connection the server has closed meanwhile fails with.
_CLOSED_BY_PEER = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class LighthouseStatus:
    """The lighthouse's status page, read again and again over one kept-alive connection.
    On a link that loses packets, a read then waits at worst for a resent packet (TCP's
    200 ms and up), never for a new connection's lost SYN, which is resent only after a
    second: a replica's start barrier ending a second late let its peers' first quorum form
    without it."""

    def __init__(self, lighthouse: str, timeout_s: float = 1.0) -> None:
        url = urllib.parse.urlsplit(lighthouse)
        if url.hostname is None:
            raise ValueError(f"not a lighthouse address: {lighthouse!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.timeout_s = timeout_s
        self.connection: http.client.HTTPConnection | None = None

    def ages(self) -> dict[str, float]:
        """replica id -> seconds since the lighthouse last heard from it (OSError when it
        cannot be read). A kept connection the lighthouse has closed is opened again."""
        kept = self.connection is not None
        try:
            return heartbeat_ages(self._read())
        except _CLOSED_BY_PEER as e:
            if not kept:
                raise self._unreadable(e) from e
            self.close()
        except (OSError, http.client.HTTPException) as e:
            raise self._unreadable(e) from e
        return self.ages()  # on a new connection: no second retry

    def _unreadable(self, error: Exception) -> OSError:
        self.close()
        return OSError(f"lighthouse status unreadable: {error}")

    def _read(self) -> str:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(
                self.host, self.port, timeout=self.timeout_s
            )
        self.connection.request("GET", "/status")
        response = self.connection.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise OSError(f"lighthouse status: HTTP {response.status}")
        return body

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


# How long a replica may be silent when no other replica that has trained is heard. The
# fast drop (the lighthouse's heartbeat timeout) is there to free survivors from a
# collective with a lost peer; with no trained survivor heard, it frees nobody, and a
# silence of the whole job is more likely the machine than the job: on a loaded machine a
# lone replica's fast drop is a false alarm that costs a restart. A truly frozen lone
# replica is fenced after this.
ALONE_TIMEOUT_S = 5.0


class LossDetector:
    """Which live replicas the lighthouse has just dropped: a replica counts once it has
    been heard from, and is reported once; at the lighthouse's timeout while another
    replica that has trained is heard, else only after ``alone_timeout_s``."""

    def __init__(self, timeout_s: float, alone_timeout_s: float = ALONE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.alone_timeout_s = alone_timeout_s
        self.heard: set[str] = set()
        self.reported: set[str] = set()

    def dropped(
        self, live: Iterable[str], ages: dict[str, float], trained: Collection[str]
    ) -> dict[str, float]:
        """replica id -> how long ago the lighthouse dropped it, for each newly dropped.
        ``trained``: the replicas that have committed a step (a joiner still healing is no
        survivor: it cannot train without the peer it heals from)."""
        live = list(live)
        heard_now = {rid for rid in live if ages.get(rid, self.timeout_s) < self.timeout_s}
        self.heard |= heard_now
        trained_heard = heard_now.intersection(trained)
        out = {}
        for rid in live:
            age = ages.get(rid)
            if age is None or rid in heard_now or rid not in self.heard or rid in self.reported:
                continue
            if trained_heard or age >= self.alone_timeout_s:  # (a silent one is not heard)
                self.reported.add(rid)
                out[rid] = age - self.timeout_s
        return out
