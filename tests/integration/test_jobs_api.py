"""The walking skeleton end to end: real uvicorn, real HTTP, real Ray, real SQLite."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ray.util.state import list_actors

from elastic.job_state import TERMINAL_STATES
from elastic_train import render
from jobs.workloads.image_classification import SmallCNN
from tests.conftest import (
    TOKEN,
    LiveServer,
    make_settings,
    small_job,
    state_address,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]


def job_state(client: httpx.Client, job_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def wait_state(client: httpx.Client, job_id: str, states: set[str], timeout: float) -> dict:
    return wait_for(
        lambda: (j := job_state(client, job_id))["state"] in states and j,
        timeout,
        what=f"{job_id} to reach {states}",
    )


def state_history(client: httpx.Client, job_id: str) -> list[str]:
    events = client.get(f"/v1/jobs/{job_id}/events").json()["items"]
    return [e["data"]["state"] for e in events if e["kind"] == "state"]


def alive_train_workers() -> list[Any]:
    return [
        a
        for a in list_actors(address=state_address(), filters=[("state", "=", "ALIVE")])
        # A warm worker (restart mode) or an in-place replica (the default here).
        if a.class_name in ("WarmWorker", "Replica")
    ]


def test_health_is_open_and_everything_else_needs_the_token(server: LiveServer) -> None:
    """Walks the OpenAPI document: every route and method but the health checks answers
    401 without a valid token."""
    anonymous = server.client(token=None)
    assert anonymous.get("/healthz").json() == {"status": "ok"}
    assert anonymous.get("/readyz").json() == {"status": "ready"}
    paths = anonymous.get("/openapi.json").json()["paths"]
    routes = {
        (m.upper(), p) for p, ops in paths.items() for m in ops if p not in ("/healthz", "/readyz")
    }
    assert {
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs"),
        ("GET", "/v1/jobs/{job_id}"),
        ("POST", "/v1/jobs/{job_id}/cancel"),
        ("GET", "/v1/jobs/{job_id}/checkpoints"),
        ("GET", "/v1/jobs/{job_id}/events"),
        ("GET", "/v1/jobs/{job_id}/metrics"),
        ("GET", "/v1/jobs/{job_id}/logs"),
        ("GET", "/v1/events"),
        ("GET", "/v1/me"),
        ("GET", "/v1/cluster"),
        ("GET", "/v1/queue"),
        ("POST", "/v1/users"),
        ("GET", "/v1/users"),
        ("POST", "/v1/tokens"),
        ("GET", "/v1/tokens"),
        ("POST", "/v1/tokens/{token_id}/revoke"),
        ("GET", "/metrics"),
    } <= routes
    # Outside /v1 only the Prometheus scrape needs a token (an admin's or the scrape token).
    assert {p for _, p in routes if not p.startswith("/v1/")} == {"/metrics"}
    # Every route the app has, in the schema or not: the open ones are exactly the API page's.
    readme = " ".join((Path(__file__).parents[2] / "docs" / "api.md").read_text().split())
    # (The /v1 routers' routes sit inside included-router entries, which have no path.)
    paths = {getattr(r, "path", None) for r in server.app.routes} - {None}
    open_paths = {p for p in paths if not str(p).startswith("/v1/")} - {"/metrics"}
    assert open_paths == {
        "/healthz",
        "/readyz",
        "/openapi.json",
        "/docs",
        "/docs-assets",
        "/",
        "/ui",
        "/ui/vendor/uplot",
        "/ui/js/states.js",
        "/favicon.ico",
    }
    assert "except these, which answer without one and carry no data of any job or user" in readme
    # The vendor mount and the generated states module are part of /ui/.
    for path in open_paths - {"/ui/vendor/uplot", "/ui/js/states.js"}:
        named = f"`{path}/`" if path == "/ui" else f"`{path}`"
        assert named in readme, path
    for path in ("/healthz", "/readyz", "/openapi.json", "/docs", "/", "/favicon.ico"):
        assert anonymous.get(path).status_code == 200, path
    for method, path in sorted(routes):
        url = path.replace("{job_id}", "job-x").replace("{token_id}", "tok-x")
        for client in (anonymous, server.client(token="wrong")):
            r = client.request(method, url)
            assert r.status_code == 401, (method, path)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["status"] == 401


def test_the_supervisor_class_is_sent_to_ray_before_the_service_listens(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Ray pickles an actor class at its first creation in a process, holding the GIL for
    0.1-0.25 s: the service does it while it starts, not at its first launch, when every
    request in flight waited for it (bench/api_load.py)."""
    from elastic.supervisor.actor import Supervisor
    from jobs import launcher

    # As in a new process: this test session's earlier services may have exported it.
    Supervisor.__ray_metadata__.last_export_cluster_and_job = None  # type: ignore[attr-defined]
    assert not launcher.supervisor_class_exported()
    with LiveServer(make_settings(tmp_path)) as live:
        # Listening means the lifespan's start is done: no submission has launched anything.
        assert launcher.supervisor_class_exported()
        with live.client() as client:
            assert client.get("/v1/jobs").json()["items"] == []
            r = client.post("/v1/jobs", json=small_job(max_steps=1_000_000))
            assert r.status_code == 201, r.text
            job = r.json()
            wait_state(client, job["id"], {"running"}, 120)
            assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
            wait_state(client, job["id"], {"cancelled"}, 60)


@pytest.mark.parametrize(
    "patch,field,message",
    [
        (
            {"scaling": {"min_workers": 3, "max_workers": 2}},
            "scaling.min_workers",
            "min_workers (3) must not exceed max_workers (2)",
        ),
        ({"workload": "video-generation"}, "workload", "unknown workload 'video-generation'"),
        (
            {"hyperparameters": {"max_steps": 5, "learning_rate": -1}},
            "hyperparameters.learning_rate",
            "Input should be greater than 0",
        ),
        (
            {"scaling": {"min_workers": 50, "max_workers": 60}},
            "scaling.min_workers",
            "min_workers is 50 but this cluster can hold at most 3 workers of {'CPU': 1.0}",
        ),
        ({"workload": "os:system"}, "workload", "module 'os' is not allowed"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field_and_creates_nothing(
    server: LiveServer, patch: dict, field: str, message: str
) -> None:
    client = server.client()
    body = {**small_job(), **patch}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["status"] == 422 and problem["title"] == "Invalid job spec"
    assert [e["field"] for e in problem["errors"]] == [field]
    assert message in problem["errors"][0]["message"]
    assert problem["detail"].startswith(f"{field}: ")
    assert client.get("/v1/jobs").json() == {"items": [], "next_cursor": None}


def test_malformed_requests_are_problems_not_500s(server: LiveServer) -> None:
    """Each answer is a problem document whose body says what was wrong and where."""
    client = server.client()

    def problem(r: httpx.Response, status: int) -> dict[str, Any]:
        assert r.status_code == status, r.text
        assert r.headers["content-type"] == "application/problem+json"
        body = r.json()
        assert body["status"] == status and body["instance"] == r.request.url.path
        return dict(body)

    body = problem(
        client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}),
        422,
    )
    assert body["title"] == "Invalid job spec"
    assert [e["field"] for e in body["errors"]] == ["(body)"]
    assert body["errors"][0]["message"].startswith("not valid JSON (at character 1")

    body = problem(client.get("/v1/jobs/job-nope"), 404)
    assert (body["title"], body["detail"]) == ("Not found", "no job 'job-nope'")

    body = problem(client.get("/v1/jobs?state=sleeping"), 422)
    assert body["title"] == "Invalid query parameter"
    assert [e["field"] for e in body["errors"]] == ["query.state"]
    assert "'queued'" in body["errors"][0]["message"]

    body = problem(client.get("/v1/jobs?cursor=abc"), 400)
    assert body["detail"] == "cursor: cursor is not one this service gave out"

    body = problem(client.get("/v1/nothing-here"), 404)
    assert body["title"] == "Not found"


def test_the_readme_job_runs_to_succeeded_and_its_checkpoint_loads(server: LiveServer) -> None:
    client = server.client()
    r = client.post("/v1/jobs", json=small_job())
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "queued" and job["name"] == "demo"

    done = wait_state(client, job["id"], TERMINAL_STATES, timeout=180)
    assert done["state"] == "succeeded", done
    assert done["step"] == 50 and done["total_steps"] == 50
    assert done["world_size"] == 0 and done["finished_at"] is not None
    assert state_history(client, job["id"]) == ["queued", "starting", "running", "succeeded"]

    events = client.get(f"/v1/jobs/{job['id']}/events").json()["items"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    attempts = [e["data"] for e in events if e["kind"] == "attempt_started"]
    assert attempts == [{"attempt": 1, "world_size": 2, "checkpoint_step": None}]
    steps = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
    assert steps == list(range(1, 51))
    assert all(e["data"]["world_size"] == 2 for e in events if e["kind"] == "metrics")

    listed = client.get("/v1/jobs", params={"state": "succeeded"}).json()["items"]
    assert [j["id"] for j in listed] == [job["id"]]
    # A page carries what the table shows: the job without its spec, with its worker bounds.
    assert listed[0] == {
        **{k: v for k, v in done.items() if k != "spec"},
        "min_workers": 1,
        "max_workers": 2,
    }

    checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
    assert [c["step"] for c in checkpoints] == [30, 40, 50]  # keep: 3
    assert all(c["size_bytes"] > 1000 for c in checkpoints)
    # One time format across the API: RFC 3339 in UTC with its offset, as the job's own.
    saved = [datetime.fromisoformat(c["created_at"]) for c in checkpoints]
    assert all(t.utcoffset() == timedelta(0) for t in saved) and saved == sorted(saved)
    started = datetime.fromisoformat(done["started_at"])
    finished = datetime.fromisoformat(done["finished_at"])
    assert started <= saved[0] and saved[-1] <= finished
    # Paths are relative to the job's checkpoint directory: they say nothing of the service's.
    job_dir = Path(server.settings.resolved_checkpoint_dir) / job["id"]
    assert [c["path"] for c in checkpoints] == [f"step_{s:010d}" for s in (30, 40, 50)]
    for c in checkpoints:
        assert (job_dir / c["path"]).is_dir()

    # The job's log says where the run is: rank 0 writes a line per epoch and per checkpoint
    # (2048 samples at 64 per step: epoch 0 ends at step 32).
    logs = client.get(f"/v1/jobs/{job['id']}/logs", params={"limit": 5000}).json()["items"]
    ours = [(e["rank"], e["stream"], e["line"]) for e in logs if "[elastic-train]" in e["line"]]
    assert ours[0][:2] == (0, "stdout")
    # Its size as `etrain checkpoints` and `etrain events` show it: one unit (the small CNN's
    # state: tens of KiB).
    (saved_10,) = [
        e["data"]["size_bytes"]
        for e in events
        if e["kind"] == "checkpoint_saved" and e["data"]["step"] == 10
    ]
    assert ours[0][2] == f"[elastic-train] checkpoint of step 10 saved ({render.size(saved_10)})"
    assert ours[0][2].endswith(" KiB)")
    saved_lines = [line for _, _, line in ours if " checkpoint of step " in line]
    assert [int(line.split()[4]) for line in saved_lines] == [10, 20, 30, 40, 50]
    assert [line for _, _, line in ours if " epoch " in line] == [
        "[elastic-train] epoch 0 ended at step 32 (2 workers)"
    ]
    assert {(rank, stream) for rank, stream, _ in ours} == {(0, "stdout")}

    state = torch.load(job_dir / checkpoints[-1]["path"] / "state.pt", weights_only=True)
    assert state["step"] == 50
    model = SmallCNN(num_classes=10)
    model.load_state_dict(state["model"])  # strict: every tensor present and shaped right
    out = model(torch.zeros(4, 3, 32, 32))
    assert out.shape == (4, 10)


def test_the_readme_curl_commands_work_as_written(server: LiveServer, tmp_path: Path) -> None:
    """Run where `make run` leaves a user: the admin token in .etrain/admin-token and the
    examples beside it. Only the address is this server's, and <id> the job's."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```sh\nTOKEN=$(cat .etrain/admin-token)\n") + len("```sh\n")
    block = readme[start : readme.index("```", start)]
    (tmp_path / ".etrain").mkdir()
    (tmp_path / ".etrain" / "admin-token").write_text(TOKEN + "\n")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    prelude, post, *reads = (
        block.replace("localhost:8000", server.url).replace("\\\n", "").splitlines()
    )

    def run(command: str) -> Any:
        done = subprocess.run(
            ["bash", "-c", f"set -e\n{prelude}\n{command}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (done.returncode, done.stderr) == (0, ""), command
        return json.loads(done.stdout)

    client = server.client()
    job = run(post)
    try:
        assert (job["name"], job["workload"], job["state"]) == (
            "demo",
            "image-classification",
            "queued",
        )
        # The README's job, with the workload's defaults filled in.
        assert job["spec"]["hyperparameters"].items() >= small_job()["hyperparameters"].items()
        shown, events, checkpoints = (run(line.replace("<id>", job["id"])) for line in reads)
        assert shown["id"] == job["id"] and shown["spec"] == job["spec"]
        assert events["items"][0]["data"]["state"] == "queued"
        assert isinstance(checkpoints["items"], list)  # none yet, or the first ones
    finally:
        client.post(f"/v1/jobs/{job['id']}/cancel")
        wait_state(client, job["id"], TERMINAL_STATES, timeout=60)


def test_cancel_ends_the_workers(server: LiveServer) -> None:
    client = server.client()
    job = client.post("/v1/jobs", json=small_job(max_steps=1_000_000)).json()
    wait_state(client, job["id"], {"running"}, timeout=180)
    assert len(alive_train_workers()) == 2

    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    assert r.json()["message"] == "cancelled by the user"
    wait_for(lambda: not alive_train_workers(), timeout=10, what="the workers to end")
    assert state_history(client, job["id"]) == ["queued", "starting", "running", "cancelled"]

    again = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and again.json()["state"] == "cancelled"


def test_a_restarted_service_finds_the_running_job(ray_cluster: Any, tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    body = small_job(max_steps=400, report_every_steps=20)
    with LiveServer(settings) as first:
        client = first.client()
        job = client.post("/v1/jobs", json=body).json()
        running = wait_state(client, job["id"], {"running"}, timeout=180)
        assert running["world_size"] == 2

    # The API was down while the job trained on: its supervisor kept the events.
    with LiveServer(make_settings(tmp_path)) as second:
        client = second.client()
        seen = job_state(client, job["id"])
        assert seen["state"] in {"running", "succeeded"}
        done = wait_state(client, job["id"], TERMINAL_STATES, timeout=180)
        assert done["state"] == "succeeded" and done["step"] == 400
        events = client.get(f"/v1/jobs/{job['id']}/events").json()["items"]
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert state_history(client, job["id"]) == ["queued", "starting", "running", "succeeded"]
        metric_steps = [e["data"]["step"] for e in events if e["kind"] == "metrics"]
        assert metric_steps == [1, *range(20, 401, 20)]
