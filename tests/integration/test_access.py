"""Users, tokens, roles and ownership, over a real server with real Ray: a user sees,
streams and cancels only their own jobs; an admin sees all."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray

from jobs.launcher import ACTOR_PREFIX
from tests.conftest import LiveServer, create_user_token, make_settings, small_job
from tests.integration.test_streams import SSE, iter_sse

# A job that would train for hours: every test cancels what it submits.
LONG = {
    **small_job(max_steps=1_000_000),
    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
}


def _as(server: LiveServer, token: str) -> httpx.Client:
    return server.client(token=token)


class Watcher:
    """Reads /v1/events in a thread until it has seen ``until`` for some job."""

    def __init__(self, server: LiveServer, token: str, until: tuple[str, str]) -> None:
        self.messages: list[dict[str, Any]] = []
        self.listening = threading.Event()
        self.until = until
        self.thread = threading.Thread(target=self._run, args=(server, token), daemon=True)
        self.thread.start()
        assert self.listening.wait(10)

    def _run(self, server: LiveServer, token: str) -> None:
        with (
            _as(server, token) as client,
            client.stream("GET", "/v1/events", headers=SSE, timeout=120) as r,
        ):
            self.listening.set()
            for message in iter_sse(r.iter_lines()):
                self.messages.append(message["data"])
                job = message["data"]["job"]
                if (job["name"], job["state"]) == self.until:
                    return

    def seen(self) -> list[tuple[str, str, str]]:
        self.thread.join(60)
        assert not self.thread.is_alive()
        return [(m["type"], m["job"]["name"], m["job"]["owner"]) for m in self.messages]


def test_users_see_stream_and_cancel_only_their_own_jobs(server: LiveServer) -> None:
    admin = server.client()
    alice = _as(server, create_user_token(admin, "alice"))
    bob = _as(server, create_user_token(admin, "bob"))
    me = alice.get("/v1/me").json()  # with her limits, see test_security.py
    assert (me["user"], me["role"]) == ("alice", "user")
    me = admin.get("/v1/me").json()
    assert (me["user"], me["role"]) == ("admin", "admin")

    # Alice's and the admin's watchers run until her last job ends, after all of Bob's
    # activity; Bob's from before Alice's first job: each stream is open while the other
    # user's jobs change, so each can show (wrongly) what it must not.
    alice_watch = Watcher(server, alice.headers["authorization"][7:], ("alices-last", "cancelled"))
    bob_watch = Watcher(server, bob.headers["authorization"][7:], ("bobs", "cancelled"))
    admin_watch = Watcher(server, admin.headers["authorization"][7:], ("alices-last", "cancelled"))

    r = alice.post("/v1/jobs", json={**LONG, "name": "alices"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["owner"] == "alice"
    for method, path in [
        ("GET", ""),
        ("POST", "/cancel"),
        ("GET", "/checkpoints"),
        ("GET", "/events"),
        ("GET", "/metrics"),
        ("GET", "/logs"),
    ]:
        r = bob.request(method, f"/v1/jobs/{job['id']}{path}")
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["detail"] == f"no job {job['id']!r}"  # as if it did not exist
    r = bob.get(f"/v1/jobs/{job['id']}/events", headers=SSE)
    assert r.status_code == 404
    assert bob.get("/v1/jobs").json() == {"items": [], "next_cursor": None}
    assert [j["id"] for j in alice.get("/v1/jobs").json()["items"]] == [job["id"]]
    assert alice.get(f"/v1/jobs/{job['id']}").json()["owner"] == "alice"

    r = alice.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text

    theirs = bob.post("/v1/jobs", json={**LONG, "name": "bobs"}).json()
    assert bob.post(f"/v1/jobs/{theirs['id']}/cancel").json()["state"] == "cancelled"
    assert bob_watch.seen()  # Bob's stream has seen his job end (and is closed)
    last = alice.post("/v1/jobs", json={**LONG, "name": "alices-last"}).json()
    assert alice.post(f"/v1/jobs/{last['id']}/cancel").json()["state"] == "cancelled"

    listed = admin.get("/v1/jobs").json()["items"]
    assert [(j["name"], j["owner"]) for j in listed] == [
        ("alices-last", "alice"),
        ("bobs", "bob"),
        ("alices", "alice"),
    ]
    assert admin.get(f"/v1/jobs/{job['id']}").status_code == 200

    assert set(alice_watch.seen()) == {
        (kind, name, "alice") for kind in ("created", "state") for name in ("alices", "alices-last")
    }
    assert set(bob_watch.seen()) == {("created", "bobs", "bob"), ("state", "bobs", "bob")}
    assert {(name, owner) for _, name, owner in admin_watch.seen()} == {
        ("alices", "alice"),
        ("bobs", "bob"),
        ("alices-last", "alice"),
    }


def test_only_an_admin_manages_users_and_a_revoked_token_stops_working(server: LiveServer) -> None:
    admin = server.client()
    carol_token = create_user_token(admin, "carol")
    carol = _as(server, carol_token)
    for method, path, body in [
        ("POST", "/v1/users", {"name": "eve"}),
        ("GET", "/v1/users", None),
        ("POST", "/v1/tokens", {"user": "carol"}),
        ("GET", "/v1/tokens", None),
        ("POST", "/v1/tokens/tok-x/revoke", None),
    ]:
        r = carol.request(method, path, json=body)
        assert r.status_code == 403, (method, path, r.text)
        assert r.headers["content-type"] == "application/problem+json"
    assert admin.post("/v1/users", json={"name": "carol"}).status_code == 409
    r = admin.post("/v1/users", json={"name": "Not A Name"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "name"
    r = admin.post("/v1/tokens", json={"user": "nobody"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "user"

    tokens = admin.get("/v1/tokens", params={"user": "carol"}).json()["items"]
    assert len(tokens) == 1 and "token" not in tokens[0]  # the secret is never shown again
    assert carol.get("/v1/jobs").status_code == 200
    r = admin.post(f"/v1/tokens/{tokens[0]['id']}/revoke")
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    r = carol.get("/v1/jobs")
    assert r.status_code == 401 and r.json()["detail"] == "the token is not valid"

    dave = _as(server, create_user_token(admin, "dave", role="admin"))
    assert dave.get("/v1/users").status_code == 200
    assert {u["name"]: u["role"] for u in admin.get("/v1/users").json()["items"]} == {
        "admin": "admin",
        "carol": "user",
        "dave": "admin",
    }


@pytest.fixture(scope="module")
def allow_listed(
    ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    settings = make_settings(
        tmp_path_factory.mktemp("allow"), entrypoint_modules=["tests.workloads"]
    )
    with LiveServer(settings) as live:
        yield live


def test_an_allowed_entrypoint_that_cannot_load_is_refused_at_submission(
    allow_listed: LiveServer,
) -> None:
    """Checked from its source on the service's path, never imported: a misspelt function
    is a 422 naming it, not three attempts of two workers."""
    with allow_listed.client() as client:
        r = client.post(
            "/v1/jobs", json={**small_job(), "workload": "tests.workloads.chatty:trian_loop"}
        )
        assert r.status_code == 422, r.text
        assert r.json()["errors"] == [
            {
                "field": "workload",
                "message": "module 'tests.workloads.chatty' defines no 'trian_loop'",
            }
        ]


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"workload": "tests.workloads.chatty:train_loop; rm -rf /"}, "workload"),
        ({"workload": "tests.workloads.chatty:$(touch /tmp/etrain-pwned)"}, "workload"),
        ({"workload": "$(touch /tmp/etrain-pwned):main"}, "workload"),
        ({"workload": "`id`:main"}, "workload"),
        ({"workload": "http://evil.example/payload:main"}, "workload"),
        ({"workload": "https://evil.example/x.py"}, "workload"),
        ({"workload": "__import__('os').system('id')"}, "workload"),
        ({"workload": "builtins:__import__"}, "workload"),
        ({"workload": "tests.workloads.chatty:__import__"}, "workload"),
        ({"workload": "tests.workloads.__init__:train_loop"}, "workload"),
        ({"workload": "os:system"}, "workload"),
        ({"workload": "subprocess:run"}, "workload"),
        ({"workload": "tests.workloadsx.evil:main"}, "workload"),
        ({"name": "x; rm -rf /"}, "name"),
        ({"name": "$(reboot)"}, "name"),
    ],
)
def test_injection_payloads_are_refused_and_nothing_runs(
    allow_listed: LiveServer, patch: dict[str, str], field: str
) -> None:
    with allow_listed.client() as client:
        r = client.post("/v1/jobs", json={**small_job(), **patch})
        assert r.status_code == 422, r.text
        assert [e["field"] for e in r.json()["errors"]] == [field]
        assert client.get("/v1/jobs").json()["items"] == []
    # Nothing of it reached Ray: no supervisor was started (the autouse fixture ended the
    # ones of earlier tests), so nothing of the workload string ever ran.
    actors = ray.util.list_named_actors(all_namespaces=True)
    assert [a for a in actors if a["name"].startswith(ACTOR_PREFIX)] == []
