"""Priorities, quotas and GET /v1/queue through the real service on the real session
cluster (a head that trains nothing and three one-CPU pool nodes): who may submit above
normal, a job over its owner's quota accepted to wait, the quotas the scheduler is told, and
the queue as each caller may see it."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import POOL_SIZE, LiveServer, create_user_token, small_job, wait_for

# Trains for hours unless stopped: every test cancels what it submits (and the conftest's
# autouse fixture ends whatever a failed test left).
LONG = {
    **small_job(max_steps=1_000_000),
    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
}


def refused(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = r.json()
    return body


def cancel_all(admin: httpx.Client) -> None:
    for job in admin.get("/v1/jobs", params={"limit": 100}).json()["items"]:
        if job["state"] not in ("succeeded", "failed", "cancelled"):
            admin.post(f"/v1/jobs/{job['id']}/cancel")


def test_only_an_admin_submits_above_normal_and_jobs_show_their_priority(
    server: LiveServer,
) -> None:
    with server.client() as admin:
        alice = server.client(token=create_user_token(admin, "alice"))
        try:
            for above in ("high", 51):
                problem = refused(alice.post("/v1/jobs", json={**LONG, "priority": above}), 403)
                assert problem["errors"] == [
                    {
                        "field": "priority",
                        "message": f"{above!r} is above normal (50); only an admin may "
                        "submit a job above normal",
                    }
                ]
            problem = refused(alice.post("/v1/jobs", json={**LONG, "priority": "urgent"}), 422)
            assert problem["errors"] == [
                {
                    "field": "priority",
                    "message": "must be one of low, normal, high or an integer from 0 to 1000",
                }
            ]
            assert alice.get("/v1/jobs").json()["items"] == []
            low = alice.post("/v1/jobs", json={**LONG, "name": "low", "priority": "low"})
            plain = alice.post("/v1/jobs", json={**LONG, "name": "plain"})
            high = admin.post("/v1/jobs", json={**LONG, "name": "high", "priority": "high"})
            assert [r.status_code for r in (low, plain, high)] == [201, 201, 201]
            listed = {j["name"]: j["priority"] for j in admin.get("/v1/jobs").json()["items"]}
            assert listed == {"low": 0, "plain": 50, "high": 100}
            one = admin.get(f"/v1/jobs/{high.json()['id']}").json()
            assert (one["priority"], one["spec"]["priority"]) == (100, "high")
            assert low.json()["priority"] == 0 and plain.json()["spec"]["priority"] == "normal"
        finally:
            cancel_all(admin)


def test_a_job_over_its_owners_quota_is_accepted_to_wait_and_the_scheduler_gets_the_quotas(
    server: LiveServer,
) -> None:
    with server.client() as admin:
        alice = server.client(token=create_user_token(admin, "alice"))
        bob = server.client(token=create_user_token(admin, "bob"))
        try:
            # Pushed at start-up: the default only, as no user has limits yet.
            assert admin.get("/v1/queue").json()["quotas"] == {"*": {"workers": None, "gpus": None}}
            r = admin.put("/v1/users/alice/limits", json={"max_workers": 1, "max_gpus": 0})
            assert r.status_code == 200, r.text
            assert admin.get("/v1/queue").json()["quotas"] == {
                "*": {"workers": None, "gpus": None},
                "alice": {"workers": 1, "gpus": 0.0},
            }
            assert alice.get("/v1/queue").json()["quotas"] == {
                "*": {"workers": None, "gpus": None},
                "alice": {"workers": 1, "gpus": 0.0},
            }
            assert bob.get("/v1/queue").json()["quotas"] == {"*": {"workers": None, "gpus": None}}

            # Up to 2 workers, over her quota of 1: accepted (it was a 422 before quotas),
            # and a second job while the first holds her quota (it was a 429).
            two = {**LONG, "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1}}
            first = alice.post("/v1/jobs", json={**two, "name": "first"})
            second = alice.post("/v1/jobs", json={**LONG, "name": "second"})
            assert [r.status_code for r in (first, second)] == [201, 201]
            assert [first.json()["state"], second.json()["state"]] == ["queued", "queued"]
            # A minimum over the quota could never run within it.
            problem = refused(
                alice.post(
                    "/v1/jobs",
                    json={
                        **LONG,
                        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
                    },
                ),
                422,
            )
            assert (problem["limit"], problem["errors"]) == (
                "max_workers",
                [
                    {
                        "field": "scaling.min_workers",
                        "message": "the job needs 2 workers at min_workers, over alice's "
                        "limit max_workers of 1",
                    }
                ],
            )
        finally:
            cancel_all(admin)


def test_the_queue_is_behind_the_token_and_answers_its_shape(server: LiveServer) -> None:
    assert server.client(token=None).get("/v1/queue").status_code == 401
    with server.client() as admin:
        r = admin.get("/v1/queue")
        assert r.status_code == 200, r.text
        assert r.json() == {
            "queue": [],
            "waiting": 0,
            "next_after_position": None,
            "running": [],
            "quotas": {"*": {"workers": None, "gpus": None}},
        }
        # Pages are bounded: a limit over the most one page holds is the API's 422.
        assert admin.get("/v1/queue", params={"limit": 1001}).status_code == 422
        assert admin.get("/v1/queue", params={"after_position": -1}).status_code == 422
        schema = admin.get("/openapi.json").json()
        answer = schema["paths"]["/v1/queue"]["get"]["responses"]["200"]
        assert answer["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/QueueOut"
        }
        entry = schema["components"]["schemas"]["QueueEntry"]["properties"]
        assert list(entry) == [
            "position",
            "priority",
            "visible",
            "job_id",
            "name",
            "owner",
            "state",
            "reason",
            "expected_start_s",
        ]


def test_a_full_cluster_queues_jobs_by_priority_and_each_user_sees_where_they_stand(
    server: LiveServer,
) -> None:
    """A high-priority job holds the whole pool; three one-worker jobs wait. The scheduler
    orders them by priority, then by submission: alice's normal, the admin's normal, bob's
    low. An admin sees them all; alice and bob see every position and priority, and only
    their own job's name."""
    whole_pool = {
        **LONG,
        "name": "whole-pool",
        "priority": "high",
        "scaling": {"min_workers": POOL_SIZE, "max_workers": POOL_SIZE, "cpus_per_worker": 1},
    }
    with server.client() as admin:
        alice = server.client(token=create_user_token(admin, "alice"))
        bob = server.client(token=create_user_token(admin, "bob"))
        try:
            big = admin.post("/v1/jobs", json=whole_pool).json()
            wait_for(
                lambda: admin.get(f"/v1/jobs/{big['id']}").json()["world_size"] == POOL_SIZE,
                180,
                what="the high-priority job on the whole pool",
            )
            alices = alice.post("/v1/jobs", json={**LONG, "name": "alices"}).json()
            admins = admin.post("/v1/jobs", json={**LONG, "name": "admins"}).json()
            bobs = bob.post("/v1/jobs", json={**LONG, "name": "bobs", "priority": "low"}).json()
            order = [alices["id"], admins["id"], bobs["id"]]
            seen = wait_for(
                lambda: (
                    (q := admin.get("/v1/queue").json())
                    and [e["job_id"] for e in q["queue"]] == order
                    and q
                ),
                120,
                what="the three waiting jobs in the scheduler's queue",
            )
            assert [(e["position"], e["priority"]) for e in seen["queue"]] == [
                (1, 50),
                (2, 50),
                (3, 0),
            ]
            assert [(e["name"], e["owner"], e["state"]) for e in seen["queue"]] == [
                ("alices", "alice", "queued"),
                ("admins", "admin", "queued"),
                ("bobs", "bob", "queued"),
            ]
            assert all(e["visible"] and e["reason"] for e in seen["queue"])
            assert [
                (e["job_id"], e["name"], e["size"], e["borrowed"], e["priority"])
                for e in seen["running"]
            ] == [(big["id"], "whole-pool", POOL_SIZE, 0, 100)]

            for client, name, mine in ((alice, "alices", 1), (bob, "bobs", 3)):
                q = client.get("/v1/queue").json()
                assert [(e["position"], e["priority"], e["visible"]) for e in q["queue"]] == [
                    (1, 50, mine == 1),
                    (2, 50, False),
                    (3, 0, mine == 3),
                ]
                (own,) = [e for e in q["queue"] if e["visible"]]
                assert (own["position"], own["name"], own["state"]) == (mine, name, "queued")
                for other in (e for e in q["queue"] if not e["visible"]):
                    assert other["job_id"] is other["name"] is other["owner"] is None
                    assert other["reason"] is None
                (running,) = q["running"]
                assert (running["visible"], running["job_id"], running["size"]) == (
                    False,
                    None,
                    POOL_SIZE,
                )
                shown = str(q)
                assert all(j not in shown for j in order if j != own["job_id"])
        finally:
            cancel_all(admin)


def test_an_ended_job_is_off_the_schedulers_book_when_its_cancel_returns(
    server: LiveServer,
) -> None:
    """Its workers are the next job's at once: a job submitted right after the cancel is not
    planned beside the ended one (which the scheduler otherwise found gone only at its next
    check, up to 5 s later; a job submitted then started at 1 worker of 3)."""
    whole = {**LONG, "scaling": {"min_workers": 1, "max_workers": POOL_SIZE, "cpus_per_worker": 1}}
    with server.client() as admin:
        job = admin.post("/v1/jobs", json=whole).json()
        wait_for(
            lambda: admin.get(f"/v1/jobs/{job['id']}").json()["state"] == "running",
            120,
            what="the job running",
        )
        assert [r["job_id"] for r in admin.get("/v1/queue").json()["running"]] == [job["id"]]
        assert admin.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
        assert admin.get("/v1/queue").json()["running"] == []
