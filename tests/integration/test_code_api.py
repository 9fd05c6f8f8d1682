"""Code packages over a real server: upload, the no-op re-upload, who may read one, each
refusal (413, 422, 415, 403), and the Python client's upload_code. No job runs here."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from elastic_train.client import Client
from elastic_train.code_archive import Packed, pack
from elastic_train.errors import CodeTooLarge
from jobs.code_store import owner_key
from tests.conftest import LiveServer, create_user_token, make_settings

MAX_CODE_BYTES = 64 * 1024
MAX_BODY_BYTES = 4096
GZIP = {"Content-Type": "application/gzip"}


@pytest.fixture(scope="module")
def live(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("code-api")
    settings = make_settings(
        root,
        checkpoint_dir=str(root / "store"),
        max_body_bytes=MAX_BODY_BYTES,
        max_code_bytes=MAX_CODE_BYTES,
        max_code_files=50,
    )
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def admin(live: LiveServer) -> Iterator[httpx.Client]:
    with live.client() as client:
        yield client


def user(live: LiveServer, admin: httpx.Client, name: str) -> httpx.Client:
    return live.client(token=create_user_token(admin, name))


def code_dir(root: Path, **files: bytes) -> Path:
    for name, data in files.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def packed(root: Path, **files: bytes) -> Packed:
    return pack(code_dir(root, **files))


def expected(p: Packed) -> dict[str, Any]:
    return {
        "id": p.content_id,
        "size_bytes": p.size_bytes,
        "files": p.files,
        "unpacked_bytes": p.unpacked_bytes,
    }


def tar_gz(*names: str, size: int = 1) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"x" * size))
    return gzip.compress(buffer.getvalue(), mtime=0)


def test_an_upload_is_201_then_a_200_no_op_with_the_same_id(
    live: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    alice = user(live, admin, "alice")
    # Bigger than max_body_bytes: the route's own limit applies to it.
    p = packed(tmp_path, train__py=b"print('train')\n", model__py=os.urandom(6000).hex().encode())
    assert MAX_BODY_BYTES < p.size_bytes < MAX_CODE_BYTES

    first = alice.post("/v1/code", content=p.data, headers=GZIP)
    assert first.status_code == 201, first.text
    assert first.json() == expected(p)
    assert first.headers["location"] == f"/v1/code/{p.content_id}"
    again = alice.post("/v1/code", content=p.data, headers={"Content-Type": "application/x-gzip"})
    assert again.status_code == 200, again.text
    assert again.json() == expected(p)
    read = alice.get(f"/v1/code/{p.content_id}")
    assert read.status_code == 200 and read.json() == expected(p)

    # Stored where a worker reads it, as uploaded, in a directory only the service reads.
    folder = Path(live.settings.resolved_checkpoint_dir) / "_code" / owner_key("alice")
    assert (folder / f"{p.content_id}.tar.gz").read_bytes() == p.data
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


def test_another_users_package_is_404_like_an_unknown_one(
    live: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    alice, bob = user(live, admin, "alice"), user(live, admin, "bob")
    p = packed(tmp_path, secret__py=b"alice's code\n")
    assert alice.post("/v1/code", content=p.data, headers=GZIP).status_code in (200, 201)

    theirs = bob.get(f"/v1/code/{p.content_id}")
    unknown = bob.get(f"/v1/code/{'0' * 64}")
    assert (theirs.status_code, unknown.status_code) == (404, 404)
    assert theirs.json()["detail"] == f"no code package {p.content_id!r}"
    assert unknown.json()["detail"] == f"no code package {'0' * 64!r}"
    assert bob.get(f"/v1/code/{p.content_id}", params={"owner": "alice"}).status_code == 404
    assert bob.get("/v1/code/not-an-id").status_code == 404

    # An admin sees another user's package when naming them, as they see all jobs.
    as_admin = admin.get(f"/v1/code/{p.content_id}", params={"owner": "alice"})
    assert as_admin.status_code == 200 and as_admin.json() == expected(p)
    assert admin.get(f"/v1/code/{p.content_id}").status_code == 404  # not the admin's own

    # The same bytes from bob are his own package: new to him.
    mine = bob.post("/v1/code", content=p.data, headers=GZIP)
    assert mine.status_code == 201 and mine.json() == expected(p)


def test_a_package_over_max_code_bytes_is_413(live: LiveServer, admin: httpx.Client) -> None:
    body = b"\x1f\x8b" + b"\0" * MAX_CODE_BYTES
    declared = admin.post("/v1/code", content=body, headers=GZIP)
    assert declared.status_code == 413, declared.text
    problem = declared.json()
    assert problem["limit"] == "max_code_bytes"
    assert (problem["max_bytes"], problem["size_bytes"]) == (MAX_CODE_BYTES, len(body))
    assert problem["detail"] == (
        f"max_code_bytes: the body is {len(body)} bytes, over the limit of {MAX_CODE_BYTES} bytes"
    )

    # Streamed in chunks without a length: cut off once past the limit.
    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_CODE_BYTES // 4096 + 2):
            yield b"\0" * 4096

    streamed = admin.post("/v1/code", content=chunks(), headers=GZIP)
    assert streamed.status_code == 413, streamed.text
    assert streamed.json()["detail"] == (
        f"max_code_bytes: the body is more than {MAX_CODE_BYTES} bytes, over the limit of "
        f"{MAX_CODE_BYTES} bytes"
    )
    # Other routes keep max_body_bytes.
    other = admin.post(
        "/v1/jobs",
        content=b"{" + b" " * MAX_BODY_BYTES + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert other.status_code == 413
    assert other.json()["detail"] == f"the body may be at most {MAX_BODY_BYTES} bytes"


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        (tar_gz("ok.py", "/etc/cron.d/evil"), "/etc/cron.d/evil", "an absolute path"),
        (tar_gz("a/../../evil.py"), "a/../../evil.py", "a '..' component in its path"),
        (tar_gz(*(f"f{i}.py" for i in range(51))), "f50.py", "more than max_files (50) entries"),
    ],
    ids=["absolute", "dotdot", "too-many-files"],
)
def test_an_unsafe_package_is_422_naming_the_entry(
    admin: httpx.Client, body: bytes, field: str, message: str
) -> None:
    r = admin.post("/v1/code", content=body, headers=GZIP)
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["title"] == "Invalid code package"
    assert problem["errors"] == [{"field": field, "message": message}]
    assert problem["detail"] == f"{field}: {message}"


def test_a_body_that_is_no_tar_gz_is_422(admin: httpx.Client) -> None:
    r = admin.post("/v1/code", content=b"PK\x03\x04 a zip", headers=GZIP)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == "the body is not a gzip-compressed tar archive"


@pytest.mark.parametrize("content_type", ["application/json", "text/plain", None])
def test_another_media_type_is_415(
    admin: httpx.Client, tmp_path: Path, content_type: str | None
) -> None:
    p = packed(tmp_path, a__py=b"a\n")
    headers = {"Content-Type": content_type} if content_type else {}
    r = admin.post("/v1/code", content=p.data, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["errors"] == [{"field": "Content-Type", "message": "expected application/gzip"}]
    octet = admin.post(
        "/v1/code", content=p.data, headers={"Content-Type": "application/octet-stream"}
    )
    assert octet.status_code in (200, 201)


def test_an_admin_turns_code_submission_off_for_a_user(
    live: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    carol = user(live, admin, "carol")
    p = packed(tmp_path, train__py=b"carol\n")
    off = admin.put("/v1/users/carol/limits", json={"code_submission": False})
    assert off.status_code == 200, off.text
    assert off.json()["limits"]["code_submission"] is False
    assert carol.get("/v1/me").json()["limits"]["code_submission"] is False
    try:
        r = carol.post("/v1/code", content=p.data, headers=GZIP)
        assert r.status_code == 403, r.text
        problem = r.json()
        assert problem["errors"] == [
            {"field": "code_submission", "message": "code submission is turned off for carol"}
        ]
        assert problem["limit"] == "code_submission"
        assert carol.get(f"/v1/code/{p.content_id}").status_code == 404  # nothing stored
        assert (
            user(live, admin, "dave").post("/v1/code", content=p.data, headers=GZIP).status_code
            == 201
        )
    finally:
        assert admin.put("/v1/users/carol/limits", json={}).status_code == 200
    assert carol.post("/v1/code", content=p.data, headers=GZIP).status_code == 201


def test_the_python_client_uploads_a_directory(
    live: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    token = create_user_token(admin, "erin")
    root = tmp_path / "project"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "train.py").write_bytes(b"print('erin')\n")
    (root / "pkg" / "util.py").write_bytes(b"x = 1\n")
    (root / "pkg" / "__pycache__" / "util.cpython-312.pyc").write_bytes(b"left out")
    (root / ".gitignore").write_text("*.ckpt\n")
    (root / "big.ckpt").write_bytes(os.urandom(200_000))  # ignored: the upload stays small
    with Client(live.url, token) as client:
        code_id = client.upload_code(root)
        assert code_id == pack(root).content_id
        assert client.upload_code(root) == code_id  # the server's 200: the same id
        info = client.request("GET", f"/v1/code/{code_id}")
        assert (info["files"], info["unpacked_bytes"]) == (3, 14 + 6 + 7)

        # Over the server's limit (not the client's): its answer, with the biggest files.
        (root / ".gitignore").write_text("")
        with pytest.raises(CodeTooLarge) as too_large:
            client.upload_code(root)
    size = pack(root).size_bytes
    assert str(too_large.value) == (
        f"the service refused the code: max_code_bytes: the body is {size} bytes, over the "
        f"limit of {MAX_CODE_BYTES} bytes; the biggest files: big.ckpt (195.3 KiB), "
        "train.py (14 B), pkg/util.py (6 B), .gitignore (0 B) (leave files out with "
        ".etrainignore)"
    )


def test_a_command_job_runs_only_on_a_package_of_its_owner_who_may_submit_code(
    live: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    """Refused at submission, so no job is made: another user's package (unknown to this
    one), and any command job of a user whose code submission is off."""
    p = packed(tmp_path, train__py=b"print('frank')\n")
    assert (
        user(live, admin, "frank").post("/v1/code", content=p.data, headers=GZIP).status_code == 201
    )
    grace = user(live, admin, "grace")
    job = {"name": "script", "command": ["python", "train.py"], "code": p.content_id}
    r = grace.post("/v1/jobs", json=job)
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [
        {
            "field": "code",
            "message": f"no code package {p.content_id} of yours: upload it first "
            "(POST /v1/code, or etrain submit --code DIR)",
        }
    ]
    assert admin.put("/v1/users/grace/limits", json={"code_submission": False}).status_code == 200
    try:
        for spec in (job, {"name": "script", "command": ["python", "-c", "print(1)"]}):
            r = grace.post("/v1/jobs", json=spec)
            assert r.status_code == 403, r.text
            assert r.json()["errors"] == [
                {"field": "code_submission", "message": "code submission is turned off for grace"}
            ]
    finally:
        assert admin.put("/v1/users/grace/limits", json={}).status_code == 200
    assert grace.get("/v1/jobs").json()["items"] == []
