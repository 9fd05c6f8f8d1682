"""A replica's extra heartbeats reach a real lighthouse, and stop when told."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from elastic.in_place.heartbeats import ExtraHeartbeats
from elastic.in_place.watchdog import LighthouseStatus


def test_extra_heartbeats_keep_a_replica_heard_and_stop_when_told() -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=300)
    url = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    beats = ExtraHeartbeats(url, timedelta(milliseconds=50), connections=2)
    status = LighthouseStatus(url)
    try:
        # Open before there is an id to beat for, and silent until told one.
        assert beats.opened(timedelta(seconds=10)) == 2
        time.sleep(0.2)
        assert status.ages() == {}
        beats.start("job-r1:0c5e")
        deadline = time.monotonic() + 10
        while "job-r1" not in status.ages():
            assert time.monotonic() < deadline, "no beat reached the lighthouse"
            time.sleep(0.02)
        ages = []
        for _ in range(20):
            ages.append(status.ages()["job-r1"])
            time.sleep(0.05)
        # Two connections, each beating every 50 ms: never near the 300 ms timeout.
        assert max(ages) < 0.15, ages
        beats.stop()
        for thread in beats.threads:
            thread.join(timeout=5)
            assert not thread.is_alive()
        stopped_at = time.monotonic()
        time.sleep(0.4)
        silent_for = status.ages()["job-r1"]
        assert silent_for >= 0.4 - 0.05 and silent_for <= time.monotonic() - stopped_at + 0.05
    finally:
        beats.stop()
        status.close()
        server.shutdown()


def test_the_lighthouse_status_is_read_over_one_kept_connection() -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=300)
    url = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    beats = ExtraHeartbeats(url, timedelta(milliseconds=50), connections=1)
    status = LighthouseStatus(url)
    try:
        beats.opened(timedelta(seconds=10))
        beats.start("job-r0:9f1d")
        deadline = time.monotonic() + 10
        while "job-r0" not in status.ages():
            assert time.monotonic() < deadline, "no beat reached the lighthouse"
            time.sleep(0.02)
        assert status.connection is not None
        kept = status.connection.sock
        for _ in range(5):
            assert status.ages()["job-r0"] < 0.3
        assert status.connection.sock is kept
        # The connection gone under it (as when the server closes an idle one): the next
        # read opens another.
        kept.shutdown(socket.SHUT_RDWR)
        assert status.ages()["job-r0"] < 0.3
        assert status.connection.sock is not kept
    finally:
        beats.stop()
        status.close()
        server.shutdown()
    # The server's shutdown ends its listener a moment later, from its own thread.
    deadline = time.monotonic() + 10
    while True:
        try:
            status.ages()
        except OSError as e:
            assert "lighthouse status unreadable" in str(e)
            break
        assert time.monotonic() < deadline, "the lighthouse still answers after its shutdown"
        status.close()
        time.sleep(0.05)
