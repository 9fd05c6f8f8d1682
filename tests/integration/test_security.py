"""Issue 13's findings as the attacks they were, through the real service on real Ray: two
ordinary users (alice and bob), every probe sent to loopback."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from elastic.job_state import TERMINAL_STATES
from service.deps import services_of
from tests.conftest import (
    LiveServer,
    create_user_token,
    make_settings,
    small_job,
    wait_for,
    wait_until_ended,
)
from tests.integration.test_streams import SSE, iter_sse

# Trains for hours unless stopped: every test cancels what it submits.
LONG = {
    **small_job(max_steps=1_000_000),
    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
}


@pytest.fixture
def secured(ray_cluster: Any, tmp_path: Path) -> Iterator[LiveServer]:
    """A service whose users each read only their own directory under tmp_path/data."""
    for user in ("alice", "bob"):
        (tmp_path / "data" / user).mkdir(parents=True)
    settings = make_settings(
        tmp_path,
        data_roots=[str(tmp_path / "data" / "{user}")],
        entrypoint_modules=["tests.workloads"],
        sse_keepalive_s=0.5,
        max_streams_per_token=3,
    )
    with LiveServer(settings) as live:
        yield live


def database_file(server: LiveServer) -> str:
    return str(server.settings.resolved_database_url.removeprefix("sqlite:///"))


def users(server: LiveServer) -> tuple[httpx.Client, httpx.Client, httpx.Client]:
    admin = server.client()
    alice = server.client(create_user_token(admin, "alice"))
    bob = server.client(create_user_token(admin, "bob"))
    return admin, alice, bob


def cancel_all(admin: httpx.Client) -> None:
    for job in admin.get("/v1/jobs", params={"limit": 500}).json()["items"]:
        if job["state"] not in TERMINAL_STATES:
            admin.post(f"/v1/jobs/{job['id']}/cancel")


def refused(r: httpx.Response, status: int, field: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = r.json()
    if field is not None:
        assert [e["field"] for e in problem["errors"]] == [field], problem
    return problem


# -- 1. code execution through a dataset file ------------------------------------------------


class RunsCode:
    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.source,))


def test_a_cifar10_batch_that_would_run_code_fails_the_job_and_runs_nothing(
    secured: LiveServer, tmp_path: Path
) -> None:
    admin, alice, _ = users(secured)
    folder = tmp_path / "data" / "alice" / "cifar"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(2, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8), b"labels": [1] * 8}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    marker = tmp_path / "pwned"
    # What the attack did: copy the service's database where the user can read it.
    steal = f"open({str(marker)!r}, 'w').write(open({database_file(secured)!r}, 'rb').read().hex())"
    payload = {b"data": RunsCode(steal), b"labels": [0]}
    (folder / "data_batch_1").write_bytes(pickle.dumps(payload, protocol=2))
    spec = small_job(dataset="cifar10", data_path=str(folder), max_steps=2, global_batch_size=8)
    spec["scaling"] = {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1}
    spec["failure"] = {"max_restarts": 0}
    try:
        r = alice.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job = wait_until_ended(alice, r.json()["id"])
    finally:
        cancel_all(admin)
    assert not marker.exists()  # the payload never ran
    assert job["state"] == "failed"
    assert "data_batch_1 is not a CIFAR-10 python batch" in job["message"], job["message"]
    assert "etrain" not in job["message"]


# -- 2. secrets in the workers' environment: see test_security_server.py ----------------------


# -- 3. data paths ---------------------------------------------------------------------------


def test_data_paths_outside_the_users_roots_are_refused_naming_the_field(
    secured: LiveServer, tmp_path: Path
) -> None:
    admin, alice, bob = users(secured)
    theirs = tmp_path / "data" / "alice" / "reviews.csv"
    theirs.write_text("text,label\nprivate words,1\nmore,0\n")
    mine = tmp_path / "data" / "bob"
    (mine / "reviews.csv").write_text("text,label\ngood,1\nbad,0\n")
    (mine / "stolen.csv").symlink_to(theirs)
    (mine / "db.txt").symlink_to(database_file(secured))
    checkpoints = secured.settings.resolved_checkpoint_dir

    def text_job(**paths: str) -> dict[str, Any]:
        hp = {"data_path": str(mine / "reviews.csv"), "epochs": 1, **paths}
        return {"name": "t", "workload": "text-classification", "hyperparameters": hp}

    def image_job(**paths: str) -> dict[str, Any]:
        return small_job(dataset="imagefolder", max_steps=1, **paths)

    cases = [
        (text_job(data_path=str(theirs)), "hyperparameters.data_path"),
        (text_job(eval_path=str(theirs)), "hyperparameters.eval_path"),
        (
            text_job(data_path=str(mine / ".." / "alice" / "reviews.csv")),
            "hyperparameters.data_path",
        ),
        (text_job(data_path=str(mine / "stolen.csv")), "hyperparameters.data_path"),
        (text_job(vocab_path=database_file(secured)), "hyperparameters.vocab_path"),
        (text_job(vocab_path=str(mine / "db.txt")), "hyperparameters.vocab_path"),
        (image_job(data_path=checkpoints), "hyperparameters.data_path"),
        (image_job(data_path="/"), "hyperparameters.data_path"),
        (image_job(data_path="data/bob"), "hyperparameters.data_path"),
    ]
    try:
        for spec, field in cases:
            problem = refused(bob.post("/v1/jobs", json=spec), 422, field)
            assert "private words" not in problem["detail"]
        assert bob.get("/v1/jobs").json()["items"] == []
        # Bob's own file, even through a link of his own, is his: the job carries its real path.
        (mine / "latest.csv").symlink_to(mine / "reviews.csv")
        r = bob.post("/v1/jobs", json=text_job(data_path=str(mine / "latest.csv")))
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["hyperparameters"]["data_path"] == str(mine / "reviews.csv")
        # Alice reads her own file.
        r = alice.post("/v1/jobs", json=text_job(data_path=str(theirs)))
        assert r.status_code == 201, r.text
    finally:
        cancel_all(admin)


def test_a_finished_run_shows_no_service_path_and_retention_deletes_its_series(
    ray_cluster: Any, tmp_path: Path
) -> None:
    settings = make_settings(tmp_path, retention_days=4 / 86400)  # 4 s
    with LiveServer(settings) as live, live.client() as client:
        job = client.post("/v1/jobs", json=small_job(max_steps=20)).json()
        done = wait_until_ended(client, job["id"])
        assert done["state"] == "succeeded"
        answers = [
            client.get(f"/v1/jobs/{job['id']}").text,
            client.get(f"/v1/jobs/{job['id']}/checkpoints").text,
            client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 5000}).text,
        ]
        assert not any(str(tmp_path) in a for a in answers), answers
        saved = client.get(
            f"/v1/jobs/{job['id']}/events", params={"kind": "checkpoint_saved"}
        ).json()["items"]
        assert [e["data"]["path"] for e in saved] == ["step_0000000010", "step_0000000020"]

        def purged() -> bool:
            metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()
            logs = client.get(f"/v1/jobs/{job['id']}/logs").json()
            return metrics["total_points"] == 0 and logs["items"] == []

        wait_for(purged, 30, what="retention to delete the finished job's series")
        kinds = {e["kind"] for e in client.get(f"/v1/jobs/{job['id']}/events").json()["items"]}
        assert "state" in kinds and "checkpoint_saved" in kinds and "metrics" not in kinds
        assert client.get(f"/v1/jobs/{job['id']}").json()["step"] == 20  # the record stays


# -- 4. limits per user -------------------------------------------------------------------------


def test_specs_that_could_never_run_are_refused_naming_the_limit(secured: LiveServer) -> None:
    admin, _, bob = users(secured)
    quarter = {**LONG, "scaling": {"min_workers": 1, "max_workers": 8, "cpus_per_worker": 0.25}}
    swarm = {
        **small_job(max_steps=1_000_000, global_batch_size=1024),
        "scaling": {"min_workers": 1, "max_workers": 1024, "cpus_per_worker": 0.001},
    }
    huge = small_job(
        model="resnet50", image_size=1024, num_classes=100_000, global_batch_size=1_048_576
    )
    (Path(secured.settings.data_roots[0].replace("{user}", "bob")) / "t.csv").write_text(
        "text,label\na,1\nb,0\n"
    )
    wide = {
        "name": "wide",
        "workload": "text-classification",
        "hyperparameters": {
            "data_path": secured.settings.data_roots[0].replace("{user}", "bob") + "/t.csv",
            "layers": 48,
            "width": 8192,
            "heads": 64,
            "epochs": 1,
        },
    }
    try:
        for spec in (quarter, swarm):
            problem = refused(bob.post("/v1/jobs", json=spec), 422, "scaling.cpus_per_worker")
            assert problem["limit"] == "min_cpus_per_worker"
        for spec in (huge, wide):
            problem = refused(bob.post("/v1/jobs", json=spec), 422, "hyperparameters")
            assert problem["limit"] == "node_memory" and "GiB" in problem["detail"]
        assert bob.get("/v1/jobs").json()["items"] == []
    finally:
        cancel_all(admin)


def test_an_admin_sets_limits_per_user_and_each_refusal_names_its_limit(
    secured: LiveServer,
) -> None:
    admin, alice, bob = users(secured)
    try:
        refused(alice.put("/v1/users/alice/limits", json={"max_active_jobs": 99}), 403)
        r = admin.put("/v1/users/alice/limits", json={"max_active_jobs": 1, "max_cpus": 1})
        assert r.status_code == 200, r.text
        assert r.json()["set"] == {
            "max_active_jobs": 1,
            "max_workers": None,
            "max_cpus": 1.0,
            "max_gpus": None,
            "max_wall_time_s": None,
            "code_submission": None,
        }
        assert alice.get("/v1/me").json()["limits"]["max_active_jobs"] == 1
        refused(admin.get("/v1/users/nobody/limits"), 404)

        assert alice.post("/v1/jobs", json=LONG).status_code == 201
        problem = refused(alice.post("/v1/jobs", json=LONG), 429)
        assert problem["limit"] == "max_active_jobs"
        two = {**LONG, "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1}}
        problem = refused(alice.post("/v1/jobs", json=two), 422, "scaling.cpus_per_worker")
        assert problem["limit"] == "max_cpus"
        assert bob.post("/v1/jobs", json=LONG).status_code == 201  # others are not held back
        assert admin.get("/v1/users/alice/limits").json()["limits"]["max_active_jobs"] == 1
    finally:
        cancel_all(admin)


def test_a_job_over_its_owners_wall_time_is_cancelled(secured: LiveServer) -> None:
    admin, alice, _ = users(secured)
    try:
        r = admin.put("/v1/users/alice/limits", json={"max_wall_time_s": 2})
        assert r.status_code == 200, r.text
        job = alice.post("/v1/jobs", json=LONG).json()
        done = wait_until_ended(alice, job["id"], timeout=180)
    finally:
        cancel_all(admin)
    assert done["state"] == "cancelled", done
    assert "max_wall_time_s" in done["message"]


# -- 7 and 9. streams ------------------------------------------------------------------------------


class Stream:
    """An SSE stream read in a thread: what it got, and whether it has ended."""

    def __init__(self, server: LiveServer, token: str, path: str, **headers: str) -> None:
        self.messages: list[dict[str, Any]] = []
        self.status: int | None = None
        self.opened = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(server, token, path, headers), daemon=True
        )
        self.thread.start()
        assert self.opened.wait(20)

    def _run(self, server: LiveServer, token: str, path: str, headers: dict[str, str]) -> None:
        with (
            server.client(token) as client,
            client.stream("GET", path, headers={**SSE, **headers}, timeout=120) as r,
        ):
            self.status = r.status_code
            self.opened.set()
            for message in iter_sse(r.iter_lines()):
                self.messages.append(message)

    def ended_within(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return not self.thread.is_alive()


def test_a_revoked_token_loses_its_open_streams(secured: LiveServer) -> None:
    admin = secured.client()
    create_user_token(admin, "alice")
    tokens = {}
    for label in ("first", "second"):
        r = admin.post("/v1/tokens", json={"user": "alice", "label": label})
        tokens[label] = r.json()
    first = Stream(secured, tokens["first"]["token"], "/v1/events")
    second = Stream(secured, tokens["second"]["token"], "/v1/events")
    time.sleep(1)
    assert first.status == 200 and not first.ended_within(0)
    # Revoked through the API: its streams end at once.
    admin.post(f"/v1/tokens/{tokens['first']['id']}/revoke")
    assert first.ended_within(5)
    assert first.messages[-1]["event"] == "revoked"
    assert not second.ended_within(1)
    # Revoked in the store by someone else (another replica): ended at the next check.
    services_of(secured.app).store.revoke_token(tokens["second"]["id"])
    assert second.ended_within(5)
    assert second.messages[-1]["event"] == "revoked"


def test_streams_per_token_are_capped(secured: LiveServer) -> None:
    admin, alice, bob = users(secured)
    token = str(alice.headers["authorization"]).split()[1]
    held = [Stream(secured, token, "/v1/events") for _ in range(3)]
    assert all(s.status == 200 for s in held)
    problem = refused(alice.get("/v1/events", headers=SSE), 429)
    assert problem["limit"] == "max_streams_per_token"
    other = Stream(secured, str(bob.headers["authorization"]).split()[1], "/v1/events")
    assert other.status == 200  # another token is not held back
    for user in ("alice", "bob"):
        for t in admin.get("/v1/tokens", params={"user": user}).json()["items"]:
            admin.post(f"/v1/tokens/{t['id']}/revoke")  # ends every stream of theirs
    # None left open: the server's shutdown at the end of the test waits for none.
    assert all(s.ended_within(5) for s in [*held, other])


def test_the_stream_of_an_ended_job_ends_at_once(secured: LiveServer) -> None:
    admin, alice, _ = users(secured)
    job = alice.post("/v1/jobs", json=LONG).json()
    alice.post(f"/v1/jobs/{job['id']}/cancel")
    last = wait_until_ended(alice, job["id"])
    events = alice.get(f"/v1/jobs/{job['id']}/events").json()["items"]
    assert last["state"] == "cancelled" and events[-1]["data"]["state"] == "cancelled"
    token = str(alice.headers["authorization"]).split()[1]
    for resume in (events[-1]["seq"], events[-1]["seq"] + 100):
        for path in (f"/v1/jobs/{job['id']}/events", f"/v1/jobs/{job['id']}/logs?follow=true"):
            stream = Stream(secured, token, path, **{"Last-Event-ID": str(resume)})
            assert stream.ended_within(3), (path, resume)
            assert stream.status == 200 and stream.messages == []
    cancel_all(admin)


# -- 8. no 500s ----------------------------------------------------------------------------------


def test_out_of_range_numbers_deep_bodies_and_nul_paths_are_4xx(secured: LiveServer) -> None:
    admin, alice, _ = users(secured)
    job = alice.post("/v1/jobs", json=LONG).json()
    alice.post(f"/v1/jobs/{job['id']}/cancel")
    base = f"/v1/jobs/{job['id']}"
    for path in (f"{base}/events", f"{base}/logs"):
        problem = refused(alice.get(path, params={"after": 2**63}), 422)
        assert problem["title"] == "Invalid query parameter"
        assert alice.get(path, params={"after": 2**63 - 1}).status_code == 200
    problem = refused(alice.get(f"{base}/events", headers={**SSE, "Last-Event-ID": "9" * 23}), 400)
    assert problem["title"] == "Invalid header"
    assert refused(alice.get("/v1/jobs", params={"limit": 0}), 422)["title"] == (
        "Invalid query parameter"
    )
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(900):
        node["a"] = {}
        node = node["a"]
    spec = {
        "name": "deep",
        "workload": "tests.workloads.chatty:train_loop",
        "hyperparameters": deep,
    }
    for headers in ({"Idempotency-Key": "deep-1"}, {}):
        problem = refused(alice.post("/v1/jobs", json=spec, headers=headers), 422)
        assert problem["title"] == "Invalid job spec"
        assert [e["field"] for e in problem["errors"]] == ["hyperparameters"]
    anonymous = secured.client(token=None)
    for path in ("/ui/%00", "/docs-assets/%00", "/ui/vendor/uplot/%00", "/v1/jobs/%00"):
        r = anonymous.get(path)
        assert r.status_code == 404, (path, r.status_code, r.text)
    cancel_all(admin)
