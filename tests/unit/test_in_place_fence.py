"""The runner fences a replica the lighthouse stopped hearing from: the lighthouse's own
status page (served by the real torchft lighthouse) is what it reads."""

from __future__ import annotations

import time
from datetime import timedelta

from torchft.coordination import LighthouseClient, LighthouseServer

from elastic.in_place.fence import heartbeats, read_status


def test_a_replica_whose_heartbeats_stop_reads_as_stale_and_a_live_one_as_fresh() -> None:
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=300
    )
    try:
        client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
        assert heartbeats(read_status(server.address())) == {}
        client.heartbeat("sup-r0:1b2c")
        client.heartbeat("sup-r1:9f8e")
        assert heartbeats(read_status(server.address())) == {"sup-r0": True, "sup-r1": True}
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # r1 keeps beating, r0 has stopped
            client.heartbeat("sup-r1:9f8e")
            time.sleep(0.05)
        assert heartbeats(read_status(server.address())) == {"sup-r0": False, "sup-r1": True}
    finally:
        server.shutdown()


def test_a_replacement_under_the_same_id_counts_fresh() -> None:
    page = (
        '<li class="heartbeat\n    old\n  ">\n    sup-r2:aaaa: seen 3.1s ago\n  </li>'
        '<li class="heartbeat\n    \n  ">\n    sup-r2:bbbb: seen 0.05s ago\n  </li>'
    )
    assert heartbeats(page) == {"sup-r2": True}
