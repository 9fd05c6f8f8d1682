"""A quorum's process group (torchft's Gloo, as a replica forms it) gives up a member that
never comes after the rendezvous timeout, not the collective timeout, and its collectives
still wait the collective timeout. Real process groups on loopback, one thread per member."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import AllreduceOptions, ReconfigureOptions

from elastic.in_place.replica import RENDEZVOUS_TIMEOUT, node_bound_gloo

COLLECTIVE = timedelta(seconds=30)


def reconfigure_all(groups: list[Any], uuid: int, handles: list[str]) -> list[Any]:
    """Each group's reconfigure, at once, as the quorum's members do: its error or None."""
    outcome: list[Any] = [None] * len(groups)

    def member(i: int) -> None:
        opts = ReconfigureOptions()
        opts.uuid, opts.handles, opts.timeout = uuid, handles, COLLECTIVE
        try:
            groups[i].reconfigure(opts)
        except Exception as e:
            outcome[i] = e

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


@pytest.fixture(autouse=True)
def gloo_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def test_a_member_that_never_comes_is_given_up_after_the_rendezvous_timeout() -> None:
    a, b, dead = (node_bound_gloo("127.0.0.1", COLLECTIVE) for _ in range(3))
    # ``dead`` was put in the quorum by the lighthouse, then died: it never reconfigures.
    handles = [g.get_reconfigure_handle() for g in (a, b, dead)]
    began = time.monotonic()
    errors = reconfigure_all([a, b], 1, handles)
    took = time.monotonic() - began
    assert all(isinstance(e, Exception) for e in errors), errors
    timeout = RENDEZVOUS_TIMEOUT.total_seconds()
    assert timeout <= took < timeout + 2.0, took

    # The next quorum, without it: the same two form a group (each with a fresh store, so
    # none reads the failed try's keys) whose collectives wait the collective timeout.
    assert reconfigure_all([a, b], 2, [g.get_reconfigure_handle() for g in (a, b)]) == [
        None,
        None,
    ]
    results: dict[str, torch.Tensor] = {}

    def reduce(name: str, group: Any, value: float, late_s: float) -> None:
        time.sleep(late_s)  # longer than the rendezvous timeout: no collective fails on it
        tensor = torch.full((3,), value, dtype=torch.float64)
        group.allreduce([tensor], AllreduceOptions()).wait()
        results[name] = tensor

    threads = [
        threading.Thread(target=reduce, args=("a", a, 1.0, 0.0)),
        threading.Thread(target=reduce, args=("b", b, 2.0, timeout + 1.0)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = torch.full((3,), 3.0, dtype=torch.float64)
    assert torch.equal(results["a"], expected) and torch.equal(results["b"], expected)


def test_the_same_members_form_their_group_again_after_a_failed_try() -> None:
    """One member late past the timeout fails the try for both; the retry of the same
    quorum (same id) forms the group."""
    a, b = node_bound_gloo("127.0.0.1", COLLECTIVE), node_bound_gloo("127.0.0.1", COLLECTIVE)
    handles = [a.get_reconfigure_handle(), b.get_reconfigure_handle()]
    late = threading.Timer(
        RENDEZVOUS_TIMEOUT.total_seconds() + 0.5,
        lambda: reconfigure_all([b], 7, handles),
    )
    late.start()
    assert isinstance(reconfigure_all([a], 7, handles)[0], Exception)
    late.join(30)
    handles = [a.get_reconfigure_handle(), b.get_reconfigure_handle()]
    assert reconfigure_all([a, b], 7, handles) == [None, None]
