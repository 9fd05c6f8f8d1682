"""Idempotent submission (IETF Idempotency-Key draft), request-body limits and per-token
rate limits, over a real server with real Ray."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    PG_URL_ENV,
    STORE_BACKENDS,
    LiveServer,
    create_user_token,
    database_url,
    make_settings,
    small_job,
    wait_for,
)
from tests.integration.test_access import LONG


def _cancel_all(client: httpx.Client) -> None:
    for job in client.get("/v1/jobs", params={"limit": 500}).json()["items"]:
        if job["state"] not in {"succeeded", "failed", "cancelled"}:
            assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200


def test_the_same_key_and_body_return_the_original_job(server: LiveServer) -> None:
    client = server.client()
    key = {"Idempotency-Key": "3f1c-first"}
    first = client.post("/v1/jobs", json=LONG, headers=key)
    assert first.status_code == 201, first.text
    again = client.post("/v1/jobs", json=LONG, headers=key)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == f"/v1/jobs/{first.json()['id']}"

    other = client.post("/v1/jobs", json={**LONG, "name": "another"}, headers=key)
    assert other.status_code == 422, other.text
    assert other.json()["errors"] == [
        {"field": "Idempotency-Key", "message": "already used with a different body"}
    ]
    # Another user's same key is theirs: a new job.
    alice = server.client(token=create_user_token(client, "alice"))
    assert alice.post("/v1/jobs", json=LONG, headers=key).status_code == 201
    # A refused spec does not use up its key.
    bad = {**LONG, "scaling": {"min_workers": 9, "max_workers": 9}}
    fresh = {"Idempotency-Key": "refused-first"}
    assert client.post("/v1/jobs", json=bad, headers=fresh).status_code == 422
    assert client.post("/v1/jobs", json=LONG, headers=fresh).status_code == 201
    assert len(client.get("/v1/jobs").json()["items"]) == 3
    _cancel_all(client)


@pytest.mark.skipif("postgresql" not in STORE_BACKENDS, reason=f"needs PostgreSQL ({PG_URL_ENV})")
def test_a_retry_while_the_first_is_processed_is_409(ray_cluster: Any, tmp_path: Path) -> None:
    """Two real requests with one key. The first is held mid-submission by a real lock: another
    session of the database holds the job_events table, so the first request has claimed its
    key (another table) and waits to write its job's first event. The retry meanwhile is 409;
    once the lock goes, the first makes the job and a later retry gets it."""
    from sqlalchemy import create_engine, text

    with (
        database_url("postgresql", tmp_path) as url,
        LiveServer(make_settings(tmp_path, database_url=url)) as live,
        live.client() as c,
    ):
        key = {"Idempotency-Key": "busy"}
        locker = create_engine(url)
        with ThreadPoolExecutor(1) as pool, locker.connect() as lock:
            lock.execute(text("LOCK TABLE job_events IN EXCLUSIVE MODE"))
            first = pool.submit(c.post, "/v1/jobs", json=LONG, headers=key)
            claimed = text("SELECT count(*) FROM idempotency_keys WHERE key = 'busy'")
            wait_for(lambda: lock.execute(claimed).scalar() == 1, 30, what="the key claimed")
            retry = c.post("/v1/jobs", json=LONG, headers=key)
            assert retry.status_code == 409, retry.text
            assert retry.headers["retry-after"] == "1"
            assert retry.json()["title"] == "Request in progress"
            assert not first.done()  # the first was in flight all along
            lock.rollback()  # the lock goes
            made = first.result(timeout=60)
        locker.dispose()
        assert made.status_code == 201, made.text
        again = c.post("/v1/jobs", json=LONG, headers=key)
        assert again.status_code == 200 and again.json()["id"] == made.json()["id"]
        assert [j["id"] for j in c.get("/v1/jobs").json()["items"]] == [made.json()["id"]]
        _cancel_all(c)


def test_fifty_concurrent_identical_submissions_make_one_job(server: LiveServer) -> None:
    def submit(_: int) -> httpx.Response:
        with server.client() as c:
            return c.post("/v1/jobs", json=LONG, headers={"Idempotency-Key": "fifty"})

    with ThreadPoolExecutor(50) as pool:
        responses = list(pool.map(submit, range(50)))
    codes = [r.status_code for r in responses]
    assert codes.count(201) == 1, codes
    assert set(codes) <= {200, 201, 409}, codes
    client = server.client()
    jobs = client.get("/v1/jobs").json()["items"]
    assert len(jobs) == 1
    assert {r.json()["id"] for r in responses if r.status_code in (200, 201)} == {jobs[0]["id"]}
    # Once the first has finished, every retry gets the job.
    assert (
        client.post("/v1/jobs", json=LONG, headers={"Idempotency-Key": "fifty"}).json()["id"]
        == jobs[0]["id"]
    )
    _cancel_all(client)


def _limited(tmp_path: Path) -> LiveServer:
    return LiveServer(
        make_settings(tmp_path, max_body_bytes=4096, rate_limit_per_s=1, rate_limit_burst=5)
    )


def test_a_body_over_the_limit_is_413(ray_cluster: Any, tmp_path: Path) -> None:
    with _limited(tmp_path) as live, live.client() as client:
        big = {
            **small_job(),
            "hyperparameters": {**small_job()["hyperparameters"], "padding": "x" * 5000},
        }
        r = client.post("/v1/jobs", json=big)
        assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json"
        assert r.json()["detail"] == "the body may be at most 4096 bytes"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
            yield b'{"name": "x", "workload": "image-classification", "pad": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert client.get("/v1/jobs").json()["items"] == []


def test_each_token_is_rate_limited_with_retry_after(ray_cluster: Any, tmp_path: Path) -> None:
    with _limited(tmp_path) as live, live.client() as admin:
        alice = live.client(token=create_user_token(admin, "alice"))  # admin: 2 used
        codes = [alice.get("/v1/jobs").status_code for _ in range(6)]
        assert codes == [200] * 5 + [429]
        r = alice.get("/v1/jobs")
        assert r.status_code == 429 and r.headers["content-type"] == "application/problem+json"
        wait = int(r.headers["retry-after"])
        assert wait == 1
        # Another token has its own budget.
        assert [admin.get("/v1/jobs").status_code for _ in range(3)] == [200, 200, 200]
        assert admin.get("/v1/jobs").status_code == 429
        time.sleep(wait)
        assert alice.get("/v1/jobs").status_code == 200
        assert live.client(token=None).get("/healthz").status_code == 200
