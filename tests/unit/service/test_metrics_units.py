"""The metrics' event histograms, fed as the service feeds them: with stored event batches."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from service.metrics import ServiceMetrics
from service.store import Store


def exposition(metrics: ServiceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }


def test_recoveries_and_checkpoint_writes_land_in_their_buckets(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'etrain.db'}")
    metrics = ServiceMetrics(store)
    metrics.observe_events(
        "job-1",
        [
            {"seq": 1, "kind": "restored", "data": {"recovery_seconds": 0.8}},
            {"seq": 2, "kind": "resized", "data": {"recovery_seconds": 0.8}},
            {"seq": 3, "kind": "restored", "data": {"recovery_seconds": 21.0}},
            # A loss announced before its recovery is done carries no seconds yet.
            {"seq": 4, "kind": "worker_lost", "data": {"recovery_seconds": None}},
            {"seq": 5, "kind": "checkpoint_saved", "data": {"step": 10, "write_seconds": 0.2}},
            {"seq": 6, "kind": "checkpoint_saved", "data": {"step": 20}},  # an older worker
        ],
    )
    found = exposition(metrics)
    restored = (("kind", "restored"),)
    assert found[("etrain_job_recovery_seconds_count", restored)] == 2
    assert found[("etrain_job_recovery_seconds_sum", restored)] == 21.8
    bucket = "etrain_job_recovery_seconds_bucket"
    assert found[(bucket, (("kind", "restored"), ("le", "1.0")))] == 1
    assert found[(bucket, (("kind", "restored"), ("le", "30.0")))] == 2
    assert found[("etrain_job_recovery_seconds_count", (("kind", "resized"),))] == 1
    assert found[("etrain_checkpoint_write_seconds_count", ())] == 1
    assert found[("etrain_checkpoint_write_seconds_sum", ())] == 0.2
    # An empty store: every state is there, at zero, so a dashboard panel is never blank.
    assert found[("etrain_jobs", (("state", "queued"),))] == 0
    assert found[("etrain_jobs", (("state", "succeeded"),))] == 0
    store.close()


def test_two_apps_do_not_share_series(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'etrain.db'}")
    one, two = ServiceMetrics(store), ServiceMetrics(store)
    one.observe_events("job-1", [{"seq": 1, "kind": "restored", "data": {"recovery_seconds": 2}}])
    count = ("etrain_job_recovery_seconds_count", (("kind", "restored"),))
    assert exposition(one)[count] == 1
    assert count not in exposition(two)
    store.close()
