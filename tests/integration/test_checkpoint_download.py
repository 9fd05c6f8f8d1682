"""A finished job's model comes back: ``GET /v1/jobs/{id}/checkpoints/{step}/download``,
``Job.download_checkpoint`` and ``etrain checkpoints download``, on the real service and a
real job's checkpoints, from a directory and from a bucket.

The files that arrive equal the stored parts byte for byte and load into the workload's
model; another user gets the 404 of an unknown job; a part changed on disk is a 409 naming
it, and the client keeps nothing."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train import (
    AsyncClient,
    CheckpointCorrupt,
    Client,
    Conflict,
    ElasticTrainError,
    Job,
    NotFound,
)
from elastic_train.checkpoint_download import unpack
from elastic_train.errors import InvalidRequest
from jobs.workloads.image_classification import build_model
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from tests.conftest import (
    TOKEN,
    LiveServer,
    create_user_token,
    make_settings,
    small_job,
    wait_until_ended,
)
from tests.integration.test_package_loops import LOOP_DIR
from tests.s3_server import S3Server, s3_server

ROOT = Path(__file__).resolve().parents[2]
# The CLI of this checkout (the installed `etrain` script may be another's).
ETRAIN = "import sys; from elastic_train.cli import main; sys.exit(main())"
# 30 steps, a checkpoint every 10, two kept: step 10 is removed by retention, 20 and 30 stay.
SPEC = {**small_job(max_steps=30), "checkpoint": {"every_steps": 10, "keep": 2}}
SPEC["scaling"] = {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1}


@pytest.fixture(scope="module")
def live(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(make_settings(tmp_path_factory.mktemp("download"))) as server:
        yield server


@pytest.fixture(scope="module")
def finished(live: LiveServer) -> dict[str, Any]:
    """Alice's finished job, with its checkpoints at steps 20 and 30."""
    admin = live.client()
    alice = live.client(create_user_token(admin, "alice"))
    r = alice.post("/v1/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    job = wait_until_ended(alice, r.json()["id"], 300)
    assert job["state"] == "succeeded", job
    listed = alice.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
    assert [(c["step"], c["path"]) for c in listed] == [
        (20, "step_0000000020"),
        (30, "step_0000000030"),
    ]
    return {"job": job, "token": alice.headers["authorization"][7:]}


def stored(live: LiveServer, job_id: str, step: int) -> Path:
    return Path(live.settings.resolved_checkpoint_dir) / job_id / f"step_{step:010d}"


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def loads_into_the_model(state_pt: Path) -> None:
    state = torch.load(state_pt, weights_only=True)
    hp = ImageClassificationHyperparameters.model_validate(SPEC["hyperparameters"])
    model = build_model(hp)
    model.load_state_dict(state["model"])  # strict: every parameter, nothing else
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state["model"][name])


def test_the_api_streams_the_checkpoint_as_a_tar_of_its_stored_files(
    live: LiveServer, finished: dict[str, Any]
) -> None:
    job_id = finished["job"]["id"]
    r = live.client(finished["token"]).get(f"/v1/jobs/{job_id}/checkpoints/30/download")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-tar"
    assert r.headers["content-disposition"] == f'attachment; filename="{job_id}-step-30.tar"'
    assert int(r.headers["content-length"]) == len(r.content)
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    on_disk = files_under(stored(live, job_id, 30))
    assert set(on_disk) == {"manifest.json", "state.pt"}
    assert got == {f"step_0000000030/{k}": v for k, v in on_disk.items()}


def test_the_client_and_the_cli_download_the_model_and_it_loads(
    live: LiveServer, finished: dict[str, Any], tmp_path: Path
) -> None:
    job_id = finished["job"]["id"]
    with Client(live.url, finished["token"]) as client:
        newest = client.job(job_id).download_checkpoint(into=tmp_path)
        assert newest == tmp_path / f"{job_id}-step-30"
        older = client.job(job_id).download_checkpoint(20, tmp_path / "older")
        assert older == tmp_path / "older" / f"{job_id}-step-20"
        # Never over what is there: a second download of the same step is refused.
        with pytest.raises(ElasticTrainError, match="already exists"):
            client.job(job_id).download_checkpoint(30, tmp_path)
    for path, step in ((newest, 30), (older, 20)):
        assert files_under(path) == files_under(stored(live, job_id, step))
        loads_into_the_model(path / "state.pt")
    # Nothing but the checkpoints' directories is left (no staging, no archive).
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{job_id}-step-30", "older"]
    assert [p.name for p in (tmp_path / "older").iterdir()] == [f"{job_id}-step-20"]

    async def by_async() -> Path:
        async with AsyncClient(live.url, finished["token"]) as client:
            job = await client.job(job_id)
            return await job.download_checkpoint(20, tmp_path / "async")

    assert files_under(asyncio.run(by_async())) == files_under(stored(live, job_id, 20))

    env = {**os.environ, "ETRAIN_URL": live.url, "ETRAIN_TOKEN": finished["token"]}
    cli = subprocess.run(
        [sys.executable, "-c", ETRAIN, "checkpoints", "download", job_id, "-o", f"{tmp_path}/cli"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == f"{tmp_path / 'cli' / f'{job_id}-step-30'}\n"
    assert files_under(tmp_path / "cli" / f"{job_id}-step-30") == files_under(
        stored(live, job_id, 30)
    )


def test_only_the_owner_and_admins_download_and_unknown_steps_are_404(
    live: LiveServer, finished: dict[str, Any], tmp_path: Path
) -> None:
    job_id = finished["job"]["id"]
    path = f"/v1/jobs/{job_id}/checkpoints/30/download"
    admin = live.client()
    assert admin.get(path).status_code == 200
    bob = live.client(create_user_token(admin, "bob"))
    r = bob.get(path)
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    # Exactly what an unknown job answers: ids cannot be probed.
    assert r.json()["detail"] == f"no job {job_id!r}"
    assert bob.get("/v1/jobs/no-such-job/checkpoints/30/download").json()["detail"] == (
        "no job 'no-such-job'"
    )
    # Bob's client, holding Alice's job as she sees it, gets the same answer.
    with (
        Client(live.url, finished["token"]) as alices,
        Client(live.url, bob.headers["authorization"][7:]) as bobs,
    ):
        as_alice_sees_it = alices.job(job_id).info
        with pytest.raises(NotFound) as e:
            Job(bobs, as_alice_sees_it).download_checkpoint(30, tmp_path)
    assert e.value.detail == f"no job {job_id!r}"
    assert list(tmp_path.iterdir()) == []

    alice = live.client(finished["token"])
    for step in (10, 25):  # 10: removed by retention; 25: never saved
        r = alice.get(f"/v1/jobs/{job_id}/checkpoints/{step}/download")
        assert r.status_code == 404, r.text
        assert r.json()["detail"] == f"no checkpoint at step {step} of job {job_id!r}"
        assert r.json()["step"] == step
    assert alice.get(f"/v1/jobs/{job_id}/checkpoints/-1/download").status_code == 422
    with Client(live.url, finished["token"]) as client, pytest.raises(NotFound) as e:
        client.job(job_id).download_checkpoint(10, tmp_path)
    assert e.value.detail == f"no checkpoint at step 10 of job {job_id!r}"
    assert list(tmp_path.iterdir()) == []


def test_a_tampered_part_is_a_409_naming_it_and_the_client_keeps_nothing(
    live: LiveServer, finished: dict[str, Any], tmp_path: Path
) -> None:
    job_id = finished["job"]["id"]
    part = stored(live, job_id, 20) / "state.pt"
    original = part.read_bytes()
    # One byte flipped in the middle, the size unchanged.
    middle = len(original) // 2
    part.write_bytes(original[:middle] + bytes([original[middle] ^ 0xFF]) + original[middle + 1 :])
    try:
        r = live.client(finished["token"]).get(f"/v1/jobs/{job_id}/checkpoints/20/download")
        assert r.status_code == 409
        assert r.headers["content-type"] == "application/problem+json"
        problem = r.json()
        assert problem["title"] == "Checkpoint corrupt"
        assert problem["part"] == "state.pt"
        assert problem["detail"] == (
            "checkpoint at step 20: state.pt: fails its checksum (SHA-256); it is not sent"
        )
        with Client(live.url, finished["token"]) as client, pytest.raises(Conflict) as e:
            client.job(job_id).download_checkpoint(20, tmp_path)
        assert "state.pt: fails its checksum" in str(e.value)
        assert list(tmp_path.iterdir()) == []  # no file, no staging left behind
    finally:
        part.write_bytes(original)


def test_the_client_refuses_an_archive_whose_part_differs_from_its_manifest(
    live: LiveServer, finished: dict[str, Any], tmp_path: Path
) -> None:
    """What a client checks itself: the archive the service sent, one byte changed on
    arrival (a disk or a proxy in between), is refused and leaves nothing behind."""
    job_id = finished["job"]["id"]
    r = live.client(finished["token"]).get(f"/v1/jobs/{job_id}/checkpoints/30/download")
    assert r.status_code == 200
    data = bytearray(r.content)
    with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
        member = tar.getmember("step_0000000030/state.pt")
    data[member.offset_data + member.size // 2] ^= 0xFF
    stage = tmp_path / ".stage"
    stage.mkdir()
    (stage / "checkpoint.tar").write_bytes(bytes(data))
    dest = tmp_path / f"{job_id}-step-30"
    with pytest.raises(CheckpointCorrupt) as e:
        unpack(stage / "checkpoint.tar", stage, dest)
    assert (e.value.part, e.value.reason) == ("state.pt", "fails its checksum (SHA-256)")
    assert not dest.exists()
    # A cut archive (the service ends the stream when a part changes while it is sent).
    (stage / "cut.tar").write_bytes(r.content[: member.offset_data + 100])
    with pytest.raises(CheckpointCorrupt) as e:
        unpack(stage / "cut.tar", stage / "cut", dest)
    assert e.value.part == "the archive"
    assert not dest.exists()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def test_a_checkpoint_in_a_bucket_downloads_the_same_way(
    ray_cluster: Any, s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.new_bucket()
    spec = {**SPEC, "hyperparameters": {**SPEC["hyperparameters"], "max_steps": 10}}
    with LiveServer(make_settings(tmp_path, checkpoint_dir=f"s3://{bucket}/etrain")) as server:
        api = server.client()
        job = api.post("/v1/jobs", json=spec).json()
        assert wait_until_ended(api, job["id"], 300)["state"] == "succeeded"
        with Client(server.url, TOKEN) as client:
            where = client.job(job["id"]).download_checkpoint(into=tmp_path / "models")
        r = api.get(f"/v1/jobs/{job['id']}/checkpoints/10/download")
        assert r.status_code == 200
        # A package's loop would write its checkpoints from a child holding no credentials
        # for the bucket: refused at submission, not failed at its first checkpoint.
        with Client(server.url, TOKEN) as client, pytest.raises(InvalidRequest) as refused:
            client.submit({"name": "loop", "entrypoint": "train.py:train_loop"}, code=LOOP_DIR)
        assert refused.value.status == 422
        assert "holds no credentials for this service's checkpoint bucket" in str(refused.value)
    assert where == tmp_path / "models" / f"{job['id']}-step-10"
    prefix = f"etrain/{job['id']}/step_0000000010/"
    keys = s3.keys(bucket, prefix)
    assert [k.removeprefix(prefix) for k in keys] == ["manifest.json", "state.pt"]
    objects = {
        k.removeprefix(prefix): s3.client().get_object(Bucket=bucket, Key=k)["Body"].read()
        for k in keys
    }
    assert files_under(where) == objects
    loads_into_the_model(where / "state.pt")
