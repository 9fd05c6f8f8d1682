"""GET /v1/cluster on the real session cluster: the nodes and their CPUs, behind the token."""

from __future__ import annotations

from tests.conftest import POOL_SIZE, LiveServer


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
