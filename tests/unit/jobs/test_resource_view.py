"""The cluster view that admission reads (jobs.cluster.ResourceView): how old its answer may
be, when it asks Ray again, and the fit and memory checks made on a view."""

from __future__ import annotations

import asyncio
import threading
import time

from jobs import launcher, memory
from jobs.cluster import ResourceView
from jobs.spec import JobSpec
from tests.clock import Clock
from tests.conftest import small_job

GIB = 1 << 30


class Cluster:
    """A stand-in for Ray's totals per node that counts how often it was asked."""

    def __init__(self, *nodes: dict[str, float]) -> None:
        self.nodes = list(nodes)
        self.asked = 0

    def totals(self) -> dict[str, dict[str, float]]:
        self.asked += 1
        return {f"node-{i}": dict(n) for i, n in enumerate(self.nodes)}


def test_the_view_is_reused_until_it_is_older_than_its_bound() -> None:
    ray, clock = Cluster({"CPU": 2.0}), Clock(100.0)
    view = ResourceView(ray.totals, max_age_s=2.0, clock=clock)
    assert view.nodes() == [{"CPU": 2.0}]
    ray.nodes.append({"CPU": 4.0})  # a node joins
    clock.now += 2.0
    assert view.nodes() == [{"CPU": 2.0}]  # exactly at the bound: still served
    assert ray.asked == 1
    clock.now += 0.001
    assert view.nodes() == [{"CPU": 2.0}, {"CPU": 4.0}]  # past it: never served
    assert ray.asked == 2


def test_refresh_always_answers_from_a_fetch_begun_after_it_was_called() -> None:
    ray, clock = Cluster({"CPU": 2.0}), Clock(100.0)
    view = ResourceView(ray.totals, max_age_s=60.0, clock=clock)
    view.nodes()
    ray.nodes[0]["CPU"] = 8.0
    clock.now += 0.5
    assert view.refresh() == [{"CPU": 8.0}]
    assert view.nodes() == [{"CPU": 8.0}]
    assert ray.asked == 2


def test_concurrent_readers_of_a_stale_view_share_one_fetch() -> None:
    release = threading.Event()
    asked = []

    def slow_totals() -> dict[str, dict[str, float]]:
        asked.append(1)
        release.wait(5)
        return {"n": {"CPU": 1.0}}

    view = ResourceView(slow_totals, max_age_s=10.0)
    answers: list[object] = []
    readers = [threading.Thread(target=lambda: answers.append(view.nodes())) for _ in range(8)]
    for r in readers:
        r.start()
    time.sleep(0.05)
    release.set()
    for r in readers:
        r.join(5)
    assert answers == [[{"CPU": 1.0}]] * 8
    assert len(asked) == 1


def test_keep_fresh_keeps_the_view_within_its_bound_without_readers_fetching() -> None:
    ray = Cluster({"CPU": 2.0})
    view = ResourceView(ray.totals, max_age_s=0.2)

    async def scenario() -> None:
        task = asyncio.create_task(view.keep_fresh())
        await asyncio.sleep(0.05)
        ray.nodes.append({"CPU": 1.0})
        await asyncio.sleep(0.3)  # more than one refresh period (0.1 s) later
        asked = ray.asked
        assert view.nodes() == [{"CPU": 2.0}, {"CPU": 1.0}]
        assert ray.asked == asked  # served from the background's refresh
        assert asked >= 3
        task.cancel()

    asyncio.run(scenario())


def test_keep_fresh_survives_a_failing_fetch() -> None:
    calls = []

    def flaky() -> dict[str, dict[str, float]]:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("GCS away")
        return {"n": {"CPU": 3.0}}

    view = ResourceView(flaky, max_age_s=0.1)

    async def scenario() -> None:
        task = asyncio.create_task(view.keep_fresh())
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(scenario())
    assert len(calls) >= 2
    assert view.nodes() == [{"CPU": 3.0}]


def test_fit_and_memory_checks_read_the_nodes_given() -> None:
    spec = JobSpec.model_validate(small_job())
    per_worker = spec.scaling.worker_resources()
    nodes = [{"CPU": 2.0, "memory": 1.5 * GIB}, {"CPU": 1.0, "memory": 8.0 * GIB}]
    fits = sum(int(n["CPU"] // per_worker["CPU"]) for n in nodes)
    assert launcher.max_workers_ever(spec, nodes) == fits
    assert launcher.max_workers_ever(spec, []) == 0
    assert memory.largest_node_memory(per_worker, nodes) == 8.0 * GIB
    assert memory.largest_node_memory({"CPU": 2.0}, nodes) == 1.5 * GIB
    assert memory.largest_node_memory({"CPU": 2.0}, [{"CPU": 2.0}]) is None
