"""A replica's extra heartbeats reach a real lighthouse, and stop when told."""

from __future__ import annotations

import time
from datetime import timedelta

from elastic.in_place.heartbeats import ExtraHeartbeats
from elastic.in_place.watchdog import read_ages


def test_extra_heartbeats_keep_a_replica_heard_and_stop_when_told() -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=300)
    url = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    beats = ExtraHeartbeats(url, "job-r1:0c5e", timedelta(milliseconds=50), connections=2)
    try:
        beats.start()
        deadline = time.monotonic() + 10
        while "job-r1" not in read_ages(url):
            assert time.monotonic() < deadline, "no beat reached the lighthouse"
            time.sleep(0.02)
        ages = []
        for _ in range(20):
            ages.append(read_ages(url)["job-r1"])
            time.sleep(0.05)
        # Two connections, each beating every 50 ms: never near the 300 ms timeout.
        assert max(ages) < 0.15, ages
        beats.stop()
        for thread in beats.threads:
            thread.join(timeout=5)
            assert not thread.is_alive()
        stopped_at = time.monotonic()
        time.sleep(0.4)
        silent_for = read_ages(url)["job-r1"]
        assert silent_for >= 0.4 - 0.05 and silent_for <= time.monotonic() - stopped_at + 0.05
    finally:
        beats.stop()
        server.shutdown()
