"""GET /v1/cluster on the real session cluster: the nodes and their CPUs, behind the token,
and whose workers run where, told to their owners only."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import POOL_SIZE, LiveServer, create_user_token, small_job, wait_for


def test_the_cluster_lists_its_live_nodes_with_their_cpus(server: LiveServer) -> None:
    anonymous = server.client(token=None)
    assert anonymous.get("/v1/cluster").status_code == 401
    with server.client() as client:
        r = client.get("/v1/cluster")
    assert r.status_code == 200, r.text
    body = r.json()
    alive = [n for n in body["nodes"] if n["alive"]]
    assert [n["is_head"] for n in alive] == [True] + [False] * POOL_SIZE  # live nodes first
    assert [n["total"] for n in alive] == [{"CPU": 0.0, "GPU": 0.0}] + [
        {"CPU": 1.0, "GPU": 0.0}
    ] * POOL_SIZE
    assert all(n["workers"] == [] for n in body["nodes"])
    assert body["jobs"] == []
    assert all(n["available"] == {"CPU": 0.0, "GPU": 0.0} for n in body["nodes"] if not n["alive"])


def test_a_user_sees_where_only_their_own_workers_run(server: LiveServer) -> None:
    """The nodes are everyone's; which job's workers sit on them is told to their owner (and
    an admin) only."""
    long_job = {
        **small_job(max_steps=1_000_000),
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
    }
    with server.client() as admin:
        alice = server.client(token=create_user_token(admin, "alice"))
        bob = server.client(token=create_user_token(admin, "bob"))
        mine = alice.post("/v1/jobs", json={**long_job, "name": "alices"}).json()
        theirs = bob.post("/v1/jobs", json={**long_job, "name": "bobs"}).json()

        def placed(client: httpx.Client) -> dict[str, Any]:
            body: dict[str, Any] = client.get("/v1/cluster").json()
            return body

        seen = wait_for(
            lambda: (
                (b := placed(admin))
                and all(j["workers"] for j in b["jobs"])
                and len(b["jobs"]) == 2
                and b
            ),
            180,
            what="both jobs' workers placed",
        )
        assert {j["name"] for j in seen["jobs"]} == {"alices", "bobs"}
        for client, own, other in ((alice, mine, theirs), (bob, theirs, mine)):
            body = placed(client)
            assert [j["id"] for j in body["jobs"]] == [own["id"]]
            workers = [w for n in body["nodes"] for w in n["workers"]]
            assert [(w["job_id"], w["rank"]) for w in workers] == [(own["id"], 0)]
            assert other["id"] not in str(body)
            assert len(body["nodes"]) == len(seen["nodes"])  # every node, all the same
        for client, job in ((alice, mine), (bob, theirs)):
            assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
