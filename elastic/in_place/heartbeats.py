"""A replica's heartbeats to its lighthouse over more than one connection.

torchft's Manager beats over one TCP connection and waits for each answer before the next
beat, so there is one packet in flight: a lost packet (or its lost answer) is resent only
after TCP's loss probe or retransmission timeout, 200 ms or more, and a lost resend doubles
that. Against the lighthouse's heartbeat timeout (``HEARTBEAT_TIMEOUT_MS``, 300 ms) one
host losing 2 % of its packets made its healthy replica look lost within a minute: dropped
from the quorum, fenced and replaced.

More connections, each beating on its own, lose packets independently: the lighthouse goes
without a beat only when every one of them stalls at once. Measured from a network
namespace losing 2 % of its packets each way, for two minutes: the longest silence the
lighthouse saw was 0.30 s over one connection and 0.08 s over three. A replica that dies,
freezes or is cut off goes silent on every connection at once, so its loss is seen as
fast as before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

# Besides the Manager's own connection.
EXTRA_CONNECTIONS = 2
# One beat's wait for its answer. A stalled connection's next beat waits behind it anyway;
# the other connections carry the beats meanwhile.
BEAT_TIMEOUT = timedelta(seconds=1)
CONNECT_TIMEOUT = timedelta(seconds=5)


class ExtraHeartbeats:
    """Beats every ``interval`` over ``connections`` connections of their own, staggered
    across the interval, from :meth:`start` until :meth:`stop`.

    The connections open at construction, before the replica has an id to beat for:
    :meth:`opened` waits for them. A replica is heard first over the Manager's connection,
    and its peers then begin its first quorum; a connection still opening then (a lost SYN
    is resent after a second) would leave that one connection to carry its beats, whose
    silences on a lossy link reach the heartbeat timeout, and the quorum would form
    without it."""

    def __init__(
        self,
        lighthouse: str,
        interval: timedelta,
        connections: int = EXTRA_CONNECTIONS,
    ) -> None:
        self.lighthouse = lighthouse
        self.replica_id = ""
        self.interval_s = interval.total_seconds()
        self.began = threading.Event()  # set by start, or by stop before it
        self.stopped = threading.Event()
        self.open = [threading.Event() for _ in range(connections)]
        self.threads = [
            threading.Thread(
                target=self._beat,
                args=(self.interval_s * (k + 1) / (connections + 1), self.open[k]),
                name=f"heartbeat-{k + 1}",
                daemon=True,
            )
            for k in range(connections)
        ]
        for thread in self.threads:
            thread.start()

    def opened(self, timeout: timedelta = CONNECT_TIMEOUT) -> int:
        """Waits until every connection is open, or ``timeout``; how many are."""
        deadline = time.monotonic() + timeout.total_seconds()
        for event in self.open:
            event.wait(max(0.0, deadline - time.monotonic()))
        return sum(event.is_set() for event in self.open)

    def start(self, replica_id: str) -> ExtraHeartbeats:
        """Beats for ``replica_id``: the id the Manager registered, with its uuid."""
        self.replica_id = replica_id
        self.began.set()
        return self

    def stop(self) -> None:
        """Each connection ends after the beat it may be sending now."""
        self.stopped.set()
        self.began.set()

    def _beat(self, offset_s: float, opened: threading.Event) -> None:
        from torchft._torchft import LighthouseClient

        client: Any = None
        beating = False
        while not self.stopped.is_set():
            # A connection that fails to open, or a beat that fails (the lighthouse
            # unreachable for now, or gone at the attempt's end), is tried again at the
            # next interval.
            with contextlib.suppress(Exception):
                if client is None:
                    client = LighthouseClient(self.lighthouse, CONNECT_TIMEOUT)
                    opened.set()
                if not beating:
                    self.began.wait()
                    beating = True
                    if self.stopped.wait(offset_s):
                        return
                if not self.stopped.is_set():
                    client.heartbeat(self.replica_id, BEAT_TIMEOUT)
            self.stopped.wait(self.interval_s)
