"""`GET /metrics` on the real service: who may scrape it, and the series a Prometheus server
would read while a job runs and after it ends, parsed with prometheus-client's own parser;
and the job's TensorBoard files, read with TensorBoard's own reader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elastic.job_state import TERMINAL_STATES
from tests.conftest import (
    LiveServer,
    create_user_token,
    make_settings,
    small_job,
    wait_for,
    wait_until_ended,
)

SCRAPE_TOKEN = "scrape-only-secret-for-prometheus"
HOLD_AT = 10


@pytest.fixture(scope="module")
def live(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = make_settings(
        tmp_path_factory.mktemp("metrics"),
        entrypoint_modules=["tests.workloads"],
        metrics_token=SCRAPE_TOKEN,
    )
    with LiveServer(settings) as server:
        yield server


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by name and label set."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(server: LiveServer, token: str = SCRAPE_TOKEN) -> dict[Any, float]:
    with server.client(token) as c:
        r = c.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    return samples(r.text)


def value(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def test_only_an_admin_or_the_scrape_token_may_read_metrics(live: LiveServer) -> None:
    with live.client(None) as anonymous:
        r = anonymous.get("/metrics")
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
    with live.client("not-a-token") as stranger:
        assert stranger.get("/metrics").status_code == 401
    with live.client() as admin:
        user_token = create_user_token(admin, "metrics-reader")
        assert admin.get("/metrics").status_code == 200
    with live.client(user_token) as user:
        r = user.get("/metrics")
        assert r.status_code == 403
        assert r.json()["detail"] == "only an admin or the metrics token may read metrics"
        # The scrape token is no API token: it opens /metrics and nothing else.
    with live.client(SCRAPE_TOKEN) as scraper:
        assert scraper.get("/v1/jobs").status_code == 401
        assert scraper.get("/metrics").status_code == 200


def test_a_running_job_and_the_requests_that_made_it_show_as_series(
    live: LiveServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    spec = small_job(gate=str(gate), hold_at_step=HOLD_AT)
    spec["workload"] = "tests.workloads.gated:train_loop"
    spec["name"] = "metrics-job"
    before = scrape(live)
    with live.client() as api:
        job = api.post("/v1/jobs", json=spec).json()
        try:
            held = wait_for(
                lambda: (j := api.get(f"/v1/jobs/{job['id']}").json())["step"] >= HOLD_AT and j,
                timeout=120,
                what="the job to reach the gate",
            )
            running = scrape(live)
            key = {"job": job["id"], "owner": "admin"}
            assert value(running, "etrain_job_step", **key) == held["step"]
            assert value(running, "etrain_job_world_size", **key) == held["world_size"] == 2
            assert value(running, "etrain_job_restarts", **key) == 0
            assert value(running, "etrain_job_samples_per_second", **key) == pytest.approx(
                held["samples_per_s"]
            )
            assert value(running, "etrain_jobs", state="running") == 1
            gate.touch()
            done = wait_until_ended(api, job["id"], 120)
        finally:
            gate.touch()
            if api.get(f"/v1/jobs/{job['id']}").json()["state"] not in TERMINAL_STATES:
                api.post(f"/v1/jobs/{job['id']}/cancel")
    assert done["state"] == "succeeded"
    # TensorBoard, read by its own reader, holds the curve the API serves, point for point.
    with live.client() as api:
        series = api.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
    board = EventAccumulator(
        str(Path(live.settings.resolved_checkpoint_dir) / job["id"] / "tensorboard"),
        size_guidance={"scalars": 0, "tensors": 0},
    )
    board.Reload()
    loss = board.Scalars("train/loss")
    assert [e.step for e in loss] == series["step"]
    assert [e.value for e in loss] == pytest.approx(series["loss"], rel=1e-6)  # float32 there
    assert [e.value for e in board.Scalars("train/world_size")] == series["world_size"]
    markers = [e.tensor_proto.string_val[0].decode() for e in board.Tensors("events/text_summary")]
    assert markers[0] == "attempt 1 began at world size 2, from the start"
    assert "checkpoint saved at step 10" in markers
    after = scrape(live)
    # A finished job leaves the per-job series; the count by state keeps it.
    assert value(after, "etrain_job_step", job=job["id"], owner="admin") is None
    assert value(after, "etrain_jobs", state="running") == 0
    assert value(after, "etrain_jobs", state="succeeded") == (
        (value(before, "etrain_jobs", state="succeeded") or 0) + 1
    )
    # The submit is counted under its route template with its status, and timed.
    submits = {"route": "/v1/jobs", "method": "POST", "status": "201"}
    assert value(after, "etrain_http_requests_total", **submits) == (
        (value(before, "etrain_http_requests_total", **submits) or 0) + 1
    )
    # Job reads are one series whatever the id: no series per job.
    reads = {
        labels
        for (name, labels) in after
        if name == "etrain_http_requests_total" and ("method", "GET") in labels
    }
    routes = {dict(labels)["route"] for labels in reads}
    assert "/v1/jobs/{job_id}" in routes and not any(job["id"] in r for r in routes)
    count = value(
        after, "etrain_http_request_duration_seconds_count", route="/v1/jobs", method="POST"
    )
    assert count == value(after, "etrain_http_requests_total", **submits)


def test_an_unknown_path_is_one_series_not_one_per_path(live: LiveServer) -> None:
    with live.client() as api:
        for path in ("/nope-1", "/nope-2", "/v1/nope"):
            assert api.get(path).status_code == 404
    found = scrape(live)
    unmatched = value(
        found, "etrain_http_requests_total", route="unmatched", method="GET", status="404"
    )
    assert unmatched is not None and unmatched >= 3
    assert not any(dict(labels).get("route", "").startswith("/nope") for (_, labels) in found)
