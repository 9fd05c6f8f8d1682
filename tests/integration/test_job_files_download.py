"""What a job writes in its own directory comes back: ``GET /v1/jobs/{id}/files``,
``Job.download_files`` and ``etrain files download``, on the real service and a real
command job that wrote nested files, a binary one, a link inside its directory and links
to the service's database and data directory.

The files arrive byte for byte; a link is never followed (the database's content is in no
archive); the links that leave the directory are left out on the client; another user
gets the 404 of an unknown job; a built-in workload's job has no files (404)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx

from elastic_train import Client, NotFound
from jobs.launcher import files_dir
from tests.conftest import LiveServer, all_events, create_user_token, small_job, wait_until_ended

ROOT = Path(__file__).resolve().parents[2]
ETRAIN = "import sys; from elastic_train.cli import main; sys.exit(main())"
BINARY = bytes((i * 7 + i // 256) % 256 for i in range(1_100_000))  # over one 1 MiB chunk

# The job's script: argv[1] is the service's database, argv[2] its data directory.
SCRIPT = """
import os, sys
here = os.environ["ETRAIN_CHECKPOINT_DIR"]
os.makedirs(os.path.join(here, "nested", "deeper"))
with open(os.path.join(here, "nested", "deeper", "notes.txt"), "w") as f:
    f.write("deep notes\\n")
with open(os.path.join(here, "weights.bin"), "wb") as f:
    f.write(bytes((i * 7 + i // 256) % 256 for i in range(1_100_000)))
with open(os.path.join(here, "nested", "log.txt"), "w") as f:
    f.write("step 1\\n")
os.symlink("nested/deeper/notes.txt", os.path.join(here, "latest"))
os.symlink(sys.argv[1], os.path.join(here, "leak"))
os.symlink(sys.argv[2], os.path.join(here, "leak-dir"))
os.symlink("../../../..", os.path.join(here, "nested", "climb"))
print("wrote")
"""

WRITTEN = {
    "nested/deeper/notes.txt": b"deep notes\n",
    "nested/log.txt": b"step 1\n",
    "weights.bin": BINARY,
}


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def log_text(api: httpx.Client, job_id: str) -> str:
    return "\n".join(line[2] for e in all_events(api, job_id, "log") for line in e["data"]["lines"])


def test_a_command_jobs_own_files_download_as_it_wrote_them(
    server: LiveServer, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "write.py").write_text(SCRIPT)
    database = Path(server.settings.resolved_database_url.removeprefix("sqlite:///"))
    secret = database.read_bytes()[:100]  # the SQLite header and the first schema bytes
    admin = server.client()
    token = create_user_token(admin, "alice")
    spec = {
        "name": "writes-files",
        "command": ["python", "write.py", str(database), str(database.parent)],
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        "failure": {"max_restarts": 0},
    }
    with Client(server.url, token) as client:
        job = client.submit(spec, code=code)
    final = wait_until_ended(admin, job.id, timeout=180)
    assert final["state"] == "succeeded", log_text(admin, job.id)
    own = Path(files_dir(server.settings.resolved_checkpoint_dir, "alice", job.id))
    assert (own / "leak").is_symlink()

    # The archive: every file byte for byte, links as links, the database never.
    r = server.client(token).get(f"/v1/jobs/{job.id}/files")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-tar"
    assert r.headers["content-disposition"] == f'attachment; filename="{job.id}-files.tar"'
    assert secret not in r.content
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:") as tar:
        members = {m.name: m for m in tar.getmembers()}
        sent = {
            name.removeprefix(f"{job.id}/"): tar.extractfile(m).read()  # type: ignore[union-attr]
            for name, m in members.items()
            if m.isfile()
        }
    assert sent == WRITTEN
    links = {n.removeprefix(f"{job.id}/"): m.linkname for n, m in members.items() if m.issym()}
    assert links == {
        "latest": "nested/deeper/notes.txt",
        "leak": str(database),
        "leak-dir": str(database.parent),
        "nested/climb": "../../../..",
    }

    # The client: the same files; the links that leave the directory are left out.
    with Client(server.url, token) as client:
        where = client.job(job.id).download_files(tmp_path / "got")
    assert where == tmp_path / "got" / job.id
    assert files_under(where) == WRITTEN
    assert (where / "latest").is_symlink() and (where / "latest").read_bytes() == b"deep notes\n"
    for name in ("leak", "leak-dir", "nested/climb"):
        assert not os.path.lexists(where / name), name
    assert [p.name for p in (tmp_path / "got").iterdir()] == [job.id]  # no staging left

    # The CLI, end to end.
    env = {**os.environ, "ETRAIN_URL": server.url, "ETRAIN_TOKEN": token}
    cli = subprocess.run(
        [sys.executable, "-c", ETRAIN, "files", "download", job.id, "-o", str(tmp_path / "cli")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == f"{tmp_path / 'cli' / job.id}\n"
    assert "leak" in cli.stderr  # the links left out are named
    assert files_under(tmp_path / "cli" / job.id) == WRITTEN

    # Another user: the 404 of an unknown job, from the API and the client alike.
    bob = create_user_token(admin, "bob")
    r = server.client(bob).get(f"/v1/jobs/{job.id}/files")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["detail"] == f"no job {job.id!r}"
    with Client(server.url, bob) as client:
        try:
            client.job(job.id).download_files(tmp_path / "bob")
        except NotFound as e:
            assert e.detail == f"no job {job.id!r}"
        else:
            raise AssertionError("bob downloaded alice's files")
    assert admin.get(f"/v1/jobs/{job.id}/files").status_code == 200

    # A job whose directory holds nothing (or is gone): a 404 that says so.
    aside = own.with_name(f"{own.name}.aside")
    own.rename(aside)
    own.mkdir()
    r = admin.get(f"/v1/jobs/{job.id}/files")
    assert r.status_code == 404
    assert r.json()["detail"] == (
        f"job {job.id!r} has no files: it wrote nothing in its ETRAIN_CHECKPOINT_DIR "
        "(or it has not started yet)"
    )
    own.rmdir()
    aside.rename(own)


def test_a_built_in_workloads_job_has_no_files(server: LiveServer) -> None:
    admin = server.client()
    builtin = admin.post("/v1/jobs", json=small_job(max_steps=2))
    assert builtin.status_code == 201, builtin.text
    job_id = builtin.json()["id"]
    r = admin.get(f"/v1/jobs/{job_id}/files")
    assert r.status_code == 404
    assert r.json()["detail"] == (
        f"job {job_id!r} runs the built-in workload 'image-classification', which has no "
        "directory of its own"
    )
    admin.post(f"/v1/jobs/{job_id}/cancel")
    wait_until_ended(admin, job_id, timeout=120)
