"""The service against a real Ray head started with token authentication
(`RAY_AUTH_MODE=token`), as `ray start` runs it on a cluster: with the right token a job
runs to the end; with a wrong token, or none, `etrain serve` stops at start with a sentence
saying the token was refused. Everything on loopback; the head is this module's own."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, small_job, wait_for
from tests.ray_head import blocking_head, clean_env, serve_env, served

RAY_TOKEN = "elastic-train-test-ray-token-0123456789"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def token_head() -> Iterator[str]:
    """A Ray head with token auth in its own process group (killed whole at the end)."""
    env = clean_env() | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_TOKEN}
    with blocking_head(env, prefix="etok-") as address:
        yield address


def _serve(tmp: Path, address: str, ray_token: str | None) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    env = serve_env(tmp, address, port)
    if ray_token is not None:
        env["ETRAIN_RAY_AUTH_TOKEN"] = ray_token
    etrain = str(Path(sys.executable).with_name("etrain"))
    proc = subprocess.Popen(
        [etrain, "serve"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def test_with_the_right_token_the_readme_job_succeeds(token_head: str, tmp_path: Path) -> None:
    env = serve_env(tmp_path, token_head, free_port()) | {"ETRAIN_RAY_AUTH_TOKEN": RAY_TOKEN}
    with served(env, tmp_path / "serve.log") as api:
        job = api.post("/v1/jobs", json=small_job()).json()
        done = wait_for(
            lambda: (
                (j := api.get(f"/v1/jobs/{job['id']}").json())["state"]
                in ("succeeded", "failed", "cancelled")
                and j
            ),
            timeout=240,
            what="the job to end",
        )
        assert (done["state"], done["step"]) == ("succeeded", 50)
        # It ran on the token head: one loopback node of 2 CPUs.
        nodes = api.get("/v1/cluster").json()["nodes"]
        assert [(n["address"], n["total"]["CPU"]) for n in nodes] == [("127.0.0.1", 2.0)]


@pytest.mark.parametrize(
    ("ray_token", "says"),
    [
        (
            "not-the-token",
            "the Ray cluster at {address} refused the Ray auth token "
            "(ETRAIN_RAY_AUTH_TOKEN or ETRAIN_RAY_AUTH_TOKEN_PATH)",
        ),
        (
            None,
            "the Ray cluster at {address} requires token authentication: set "
            "ETRAIN_RAY_AUTH_TOKEN (or ETRAIN_RAY_AUTH_TOKEN_PATH) to its token",
        ),
    ],
    ids=["wrong-token", "no-token"],
)
def test_a_refused_token_stops_the_service_saying_so(
    token_head: str, tmp_path: Path, ray_token: str | None, says: str
) -> None:
    began = time.monotonic()
    proc, _ = _serve(tmp_path, token_head, ray_token)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert says.format(address=token_head) in out
    # Told at once, not after ray.init's 20 s of retries.
    assert time.monotonic() - began < 20
