"""The supervisor's watch on its replicas' heartbeats, as its lighthouse sees them.

The lighthouse drops a replica from the next quorum when its heartbeats stop for
``HEARTBEAT_TIMEOUT_MS``; the replicas in a collective with it learn nothing from that
(see elastic/in_place/abort.py). The lighthouse shows its view only on its status page
(``/status``: ``<replica id>: seen <seconds>s ago`` per replica), read here from the
supervisor's own process every ``POLL_S``.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable

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


def read_ages(lighthouse: str, timeout_s: float = 1.0) -> dict[str, float]:
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=timeout_s) as response:
        return heartbeat_ages(response.read().decode())


class LossDetector:
    """Which live replicas the lighthouse has just dropped: a replica counts once it has
    been heard from, and is reported once."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.heard: set[str] = set()
        self.reported: set[str] = set()

    def dropped(self, live: Iterable[str], ages: dict[str, float]) -> dict[str, float]:
        """replica id -> how long ago the lighthouse dropped it, for each newly dropped."""
        out = {}
        for rid in live:
            age = ages.get(rid)
            if age is None:
                continue
            if age < self.timeout_s:
                self.heard.add(rid)
            elif rid in self.heard and rid not in self.reported:
                self.reported.add(rid)
                out[rid] = age - self.timeout_s
        return out
