"""The in-place loss detection and step abort, without Ray: the lighthouse's status page
parsed, a dropped replica reported once, and a blocked collective's step discarded."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch

from elastic.in_place.abort import PeerLost, StepAbort
from elastic.in_place.watchdog import LighthouseStatus, LossDetector, heartbeat_ages

PAGE = """
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
  ">
    job-a-r0:10d1a94b-edf2-4d74-937a-cc8e07ef7f78: seen 0.018478163s ago
  </li>
  <li class="heartbeat
    old
  ">
    job-a-r1:9dcdf5d0-dfa1-4780-aad4-e9bc480c68aa: seen 0.723977309s ago
  </li>
  <li class="heartbeat">
    job-a-r2: seen 12.5ms ago
  </li>
</ul>
"""


def test_heartbeat_ages_are_read_from_the_status_page() -> None:
    ages = heartbeat_ages(PAGE)
    assert ages.keys() == {"job-a-r0", "job-a-r1", "job-a-r2"}
    assert abs(ages["job-a-r0"] - 0.018478163) < 1e-12
    assert abs(ages["job-a-r1"] - 0.723977309) < 1e-12
    assert abs(ages["job-a-r2"] - 0.0125) < 1e-12


def test_a_real_lighthouse_page_is_read() -> None:
    from torchft.coordination import LighthouseClient, LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=500)
    try:
        client = LighthouseClient(server.address(), timedelta(seconds=5))
        client.heartbeat("x-r0")
        client.heartbeat("x-r1")
        ages = LighthouseStatus(server.address()).ages()
        assert ages.keys() == {"x-r0", "x-r1"}
        assert all(0 <= a < 0.5 for a in ages.values())
    finally:
        server.shutdown()


def test_a_dropped_replica_is_reported_once_and_only_after_it_was_heard() -> None:
    d = LossDetector(0.5)
    live = ["r0", "r1", "r2"]
    trained = set(live)
    # r2 never heartbeated fresh (a replica still starting): never reported.
    assert d.dropped(live, {"r0": 0.1, "r1": 0.1, "r2": 3.0}, trained) == {}
    out = d.dropped(live, {"r0": 0.1, "r1": 0.62, "r2": 3.0}, trained)
    assert out.keys() == {"r1"} and abs(out["r1"] - 0.12) < 1e-9
    assert d.dropped(live, {"r0": 0.1, "r1": 0.9, "r2": 3.0}, trained) == {}
    # A replica no longer live (finished, replaced) is not watched.
    assert d.dropped(["r1"], {"r0": 5.0, "r1": 5.0}, trained) == {}


def test_a_lone_trained_replica_is_given_the_long_timeout_even_beside_healing_joiners() -> None:
    """r0 trains alone; r3 and r4 joined and heartbeat but have committed nothing (they heal
    from r0). A silent r0 frees nobody by a fast fence: it is reported only after the
    long timeout, and then once."""
    d = LossDetector(0.3, alone_timeout_s=5.0)
    live = ["r0", "r3", "r4"]
    fresh = {"r0": 0.05, "r3": 0.05, "r4": 0.05}
    assert d.dropped(live, fresh, {"r0"}) == {}
    assert d.dropped(live, fresh | {"r0": 0.4}, {"r0"}) == {}
    assert d.dropped(live, fresh | {"r0": 4.9}, {"r0"}) == {}
    out = d.dropped(live, fresh | {"r0": 5.2}, {"r0"})
    assert out.keys() == {"r0"} and abs(out["r0"] - 4.9) < 1e-9
    assert d.dropped(live, fresh | {"r0": 6.0}, {"r0"}) == {}


def test_a_silence_of_every_replica_at_once_is_no_loss_until_the_long_timeout() -> None:
    """Every replica late together (a starved machine, or a starved lighthouse): none is
    fenced at the heartbeat timeout; a trained peer heard again makes a still-silent one a
    loss at once."""
    d = LossDetector(0.3, alone_timeout_s=5.0)
    live = ["r0", "r1", "r2"]
    trained = set(live)
    assert d.dropped(live, {"r0": 0.1, "r1": 0.1, "r2": 0.1}, trained) == {}
    assert d.dropped(live, {"r0": 0.7, "r1": 0.6, "r2": 0.5}, trained) == {}
    out = d.dropped(live, {"r0": 0.01, "r1": 0.02, "r2": 0.9}, trained)
    assert out.keys() == {"r2"} and abs(out["r2"] - 0.6) < 1e-9
    # A joiner heard while untrained is no survivor for r0; trained r1 is.
    d = LossDetector(0.3, alone_timeout_s=5.0)
    fresh = {"r0": 0.05, "r1": 0.05, "r3": 0.05}
    assert d.dropped(["r0", "r1", "r3"], fresh, {"r0", "r1"}) == {}
    assert d.dropped(["r0", "r1", "r3"], fresh | {"r0": 0.5, "r1": 0.5}, {"r0", "r1"}) == {}
    out = d.dropped(["r0", "r1", "r3"], fresh | {"r0": 0.5}, {"r0", "r1"})
    assert out.keys() == {"r0"}


class _Manager:
    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self._pg = None

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


class _Work:
    """A collective in flight: a c10d future that completes when told to."""

    def __init__(self) -> None:
        self._work = self
        self.fut: torch.futures.Future[Any] = torch.futures.Future()
        self.waited = False

    def get_future(self) -> torch.futures.Future[Any]:
        return self.fut

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_blocked_collective_is_abandoned_on_request() -> None:
    abort, manager, work = StepAbort(), _Manager(), _Work()
    abort.new_step()
    t0 = time.monotonic()  # before the timer starts: it fires no sooner than 0.2 s after
    threading.Timer(0.2, abort.request, args=(0.0,)).start()
    assert abort.wait_all([work], manager) is False
    assert 0.2 <= time.monotonic() - t0 < 0.5
    assert [type(e) for e in manager.errors] == [PeerLost]
    assert not work.waited and abort.aborted_steps == 1
    work.fut.set_result(None)  # the buried collective ends later: nothing more happens
    time.sleep(0.05)
    assert len(manager.errors) == 1


def test_a_completed_collective_is_waited_and_the_step_kept() -> None:
    abort, manager, work = StepAbort(), _Manager(), _Work()
    abort.new_step()
    threading.Timer(0.1, work.fut.set_result, args=(None,)).start()
    assert abort.wait_all([work], manager) is True
    assert work.waited and manager.errors == []


def test_a_step_whose_quorum_was_asked_after_the_drop_is_not_aborted() -> None:
    abort = StepAbort()
    abort.new_step()
    # Dropped 1 s ago, before this step asked for its quorum: that quorum is without it.
    assert abort.request(1.0) is False
    work = _Work()
    work.fut.set_result(None)
    assert abort.wait_all([work], _Manager()) is True
    # Dropped just now: this step's quorum may hold it.
    assert abort.request(0.0) is True
    abort.new_step()  # the next step starts clean
    assert abort.wait_all([work], _Manager()) is True
