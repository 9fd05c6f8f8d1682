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


def read_ages(lighthouse: str, timeout_s: float = 1.0) -> dict[str, float]:
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=timeout_s) as response:
        return heartbeat_ages(response.read().decode())


# How long a replica may be silent when no other replica that has trained is heard. The
# fast drop (the lighthouse's heartbeat timeout) is there to free survivors from a
# collective with a lost peer; with no trained survivor heard, it frees nobody, and a
# silence of the whole job is more likely the machine than the job: on a loaded 2-core
# machine a lone replica's fast drop was a false alarm that cost a restart (seen in a
# parallel test run, 2026-11-25). A truly frozen lone replica is fenced after this.
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
