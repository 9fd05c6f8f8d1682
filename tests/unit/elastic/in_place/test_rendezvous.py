"""A quorum smaller than the last one (after a loss) forms its process group (torchft's Gloo,
as a replica forms it) or gives up a member that never comes within the rendezvous timeout,
not the collective timeout, and its collectives still wait the collective timeout; a quorum
that grows waits for a late joiner. Real process groups on loopback, a thread per member."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

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


def formed(groups: list[Any], uuid: int) -> list[Any]:
    """The groups' quorum formed (each group with a fresh handle)."""
    return reconfigure_all(groups, uuid, [g.get_reconfigure_handle() for g in groups])


def given_up_after_a_loss() -> None:
    a, b, dying, lost = (node_bound_gloo("127.0.0.1", COLLECTIVE) for _ in range(4))
    assert formed([a, b, dying, lost], 1) == [None] * 4  # training at 4
    # ``lost`` is gone; ``dying`` was put in the next quorum by the lighthouse, then died:
    # it never forms the group.
    handles = [g.get_reconfigure_handle() for g in (a, b, dying)]
    began = time.monotonic()
    errors = reconfigure_all([a, b], 2, handles)
    took = time.monotonic() - began
    assert all(isinstance(e, Exception) for e in errors), errors
    timeout = RENDEZVOUS_TIMEOUT.total_seconds()
    assert timeout <= took < timeout + 2.0, took

    # The next quorum, without it: the same two form a group (each with a fresh store, so
    # none reads the failed try's keys) whose collectives wait the collective timeout.
    assert formed([a, b], 3) == [None, None]
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


def waits_for_a_late_joiner() -> None:
    a, b = node_bound_gloo("127.0.0.1", COLLECTIVE), node_bound_gloo("127.0.0.1", COLLECTIVE)
    assert formed([a], 1) == [None]
    joiner = node_bound_gloo("127.0.0.1", COLLECTIVE)
    handles = [g.get_reconfigure_handle() for g in (a, b, joiner)]
    late = threading.Timer(
        RENDEZVOUS_TIMEOUT.total_seconds() + 1.0,
        lambda: reconfigure_all([joiner], 2, handles),
    )
    late.start()
    assert reconfigure_all([a, b], 2, handles) == [None, None]
    late.join(30)


def formed_again_after_a_failed_try() -> None:
    """After a loss, one member late past the timeout fails the try for all; the retry of
    the same quorum (same id) forms the group."""
    a, b, c = (node_bound_gloo("127.0.0.1", COLLECTIVE) for _ in range(3))
    assert formed([a, b, c], 1) == [None, None, None]
    handles = [a.get_reconfigure_handle(), b.get_reconfigure_handle()]
    late = threading.Timer(
        RENDEZVOUS_TIMEOUT.total_seconds() + 0.5,
        lambda: reconfigure_all([b], 7, handles),
    )
    late.start()
    assert isinstance(reconfigure_all([a], 7, handles)[0], Exception)
    late.join(30)
    assert formed([a, b], 7) == [None, None]


def tried_late(groups: list[Any], late: Any, uuid: int, late_s: float) -> tuple[list[Any], float]:
    """One try of the quorum ``groups`` + ``late``, with ``late`` coming ``late_s`` after
    the others: the others' errors (None: formed), and how long their try took."""
    handles = [g.get_reconfigure_handle() for g in [*groups, late]]
    comes = threading.Timer(late_s, lambda: reconfigure_all([late], uuid, handles))
    comes.start()
    began = time.monotonic()
    errors = reconfigure_all(groups, uuid, handles)
    took = time.monotonic() - began
    comes.join(30)
    return errors, took


def waits_longer_after_each_failed_try() -> None:
    """A member later than the rendezvous timeout at each try (a starved process): each try
    waits twice as long as the one before, so a later try forms the group; once it has
    formed, the next shrink waits the rendezvous timeout again."""
    a, b, c, d = (node_bound_gloo("127.0.0.1", COLLECTIVE) for _ in range(4))
    assert formed([a, b, c, d], 1) == [None] * 4
    timeout = RENDEZVOUS_TIMEOUT.total_seconds()
    errors, took = tried_late([a, b], c, 2, 1.5 * timeout)
    assert all(isinstance(e, Exception) for e in errors), errors
    assert timeout <= took < 1.5 * timeout, took
    errors, took = tried_late([a, b], c, 3, 1.5 * timeout)
    assert errors == [None, None], (errors, took)
    assert 1.5 * timeout <= took < 2 * timeout, took
    # Formed at 3; ``b`` is lost, and ``c``, put in the next quorum, never comes: given up
    # after the timeout again, not twice it.
    handles = [g.get_reconfigure_handle() for g in (a, c)]
    began = time.monotonic()
    errors = reconfigure_all([a], 4, handles)
    took = time.monotonic() - began
    assert isinstance(errors[0], Exception), errors
    assert timeout <= took < 1.5 * timeout, took
    assert formed([a], 5) == [None]


def _scenario(name: str, errors: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        globals()[name]()
    except BaseException:
        errors.put(traceback.format_exc())
        raise
    errors.put(None)


def in_a_fresh_process(scenario: Callable[[], None]) -> None:
    """Runs ``scenario`` in a process of its own, as replicas are: its groups, stores and
    their native threads end with it, never in the test runner's process."""
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    process = context.Process(target=_scenario, args=(scenario.__name__, errors))
    process.start()
    try:
        error = errors.get(timeout=120)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert error is None, error


def test_after_a_loss_a_member_that_never_comes_is_given_up_after_the_rendezvous_timeout() -> None:
    in_a_fresh_process(given_up_after_a_loss)


def test_a_quorum_that_grows_waits_for_a_late_joiner() -> None:
    in_a_fresh_process(waits_for_a_late_joiner)


def test_the_same_members_form_their_group_again_after_a_failed_try() -> None:
    in_a_fresh_process(formed_again_after_a_failed_try)


def test_each_failed_try_of_a_shrunk_quorum_waits_twice_as_long_as_the_one_before() -> None:
    in_a_fresh_process(waits_longer_after_each_failed_try)
