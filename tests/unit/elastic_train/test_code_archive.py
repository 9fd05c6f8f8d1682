"""Packing a code directory: what is left out, links, and the same bytes for the same tree."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from elastic_train.code_archive import pack
from elastic_train.errors import CodeArchiveError
from elastic_train.ignore_rules import IgnoreRules


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return tar.getnames()


def test_git_caches_and_virtual_environments_are_left_out(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "train.py": "print('hi')\n",
            "pkg/model.py": "x = 1\n",
            "pkg/__pycache__/model.cpython-312.pyc": "bytecode",
            "pkg/old.pyc": "bytecode",
            ".git/HEAD": "ref: refs/heads/main\n",
            ".venv/bin/python": "",
            "venv/lib/site.py": "",
            "myenv/pyvenv.cfg": "home = /usr/bin\n",
            "myenv/lib/thing.py": "",
        },
    )
    packed = pack(tmp_path)
    assert names(packed.data) == ["pkg", "pkg/model.py", "train.py"]
    assert packed.files == 2
    assert packed.unpacked_bytes == len("print('hi')\n") + len("x = 1\n")
    assert packed.biggest == [("train.py", 12), ("pkg/model.py", 6)]


def test_gitignore_and_etrainignore_rules(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            ".gitignore": "# logs and data\n\n*.log\n!keep.log\n/data/\nbuild/\n**/tmp/**\n",
            ".etrainignore": "docs/*.md\n!docs/README.md\nsecret?.txt\nnotes/\n",
            "a.log": "",
            "sub/b.log": "",
            "keep.log": "kept",
            "data/x.bin": "",
            "sub/data/y.bin": "kept: /data/ is anchored at the root",
            "build/out.o": "",
            "sub/build/out.o": "",
            "build.txt": "kept: build/ matches directories only",
            "deep/a/tmp/t.txt": "",
            "docs/guide.md": "",
            "docs/README.md": "kept: taken back in",
            "docs/api/deep.md": "kept: * does not cross a slash",
            "secret1.txt": "",
            "secret12.txt": "kept: ? is one character",
            "notes": "kept: a file, and notes/ names directories",
        },
    )
    found = [n for n, m in members(pack(tmp_path).data).items() if not m.isdir()]
    assert found == [
        ".etrainignore",
        ".gitignore",
        "build.txt",
        "docs/README.md",
        "docs/api/deep.md",
        "keep.log",
        "notes",
        "secret12.txt",
        "sub/data/y.bin",
    ]


def test_nothing_under_an_ignored_directory_comes_back(tmp_path: Path) -> None:
    # As in git: a negation cannot take back a file whose directory is excluded.
    write(tmp_path, {".etrainignore": "out/\n!out/keep.txt\n", "out/keep.txt": "", "a.py": ""})
    assert names(pack(tmp_path).data) == [".etrainignore", "a.py"]


@pytest.mark.parametrize(
    ("pattern", "path", "is_dir", "ignored"),
    [
        ("*.py", "a/b/c.py", False, True),
        ("/*.py", "a/c.py", False, False),
        ("/*.py", "c.py", False, True),
        ("a/*.py", "a/c.py", False, True),
        ("a/*.py", "x/a/c.py", False, False),
        ("**/foo", "x/y/foo", False, True),
        ("**/foo", "foo", False, True),
        ("a/**/b", "a/b", False, True),
        ("a/**/b", "a/x/y/b", False, True),
        ("abc/**", "abc/x/y", False, True),
        ("abc/**", "abc", True, False),
        ("cache/", "cache", False, False),
        ("cache/", "x/cache", True, True),
        ("[ab].txt", "b.txt", False, True),
        ("[!ab].txt", "c.txt", False, True),
        ("[!ab].txt", "a.txt", False, False),
        ("\\#hash", "#hash", False, True),
        ("\\!bang", "!bang", False, True),
        ("trail   ", "trail", False, True),
    ],
)
def test_one_pattern(pattern: str, path: str, is_dir: bool, ignored: bool) -> None:
    assert IgnoreRules.parse(pattern).ignored(path, is_dir) is ignored


def test_the_last_matching_rule_wins() -> None:
    rules = IgnoreRules.parse("*.txt\n!a*.txt\nab.txt\n")
    assert [rules.ignored(p, False) for p in ("x.txt", "a.txt", "ab.txt")] == [True, False, True]


def test_the_same_tree_packs_to_the_same_bytes(tmp_path: Path) -> None:
    files = {"b.py": "b\n", "a/z.py": "z\n", "a/y.sh": "#!/bin/sh\n", "c/d/e.txt": "e\n"}
    one, two = tmp_path / "one", tmp_path / "two"
    write(one, files)
    write(two, dict(reversed(files.items())))  # made in another order, at other times
    for root in (one, two):
        (root / "a/y.sh").chmod(0o700)
    os.utime(two / "b.py", (1_000_000, 1_000_000))
    first, again, other = pack(one), pack(one), pack(two)
    assert first.data == again.data == other.data
    assert first.content_id == other.content_id
    assert gzip.decompress(first.data)  # a real gzip stream
    assert first.data[4:8] == b"\0\0\0\0"  # no time in the gzip header
    found = members(first.data)
    assert list(found) == sorted(found)
    for m in found.values():
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
    assert found["a/y.sh"].mode == 0o755
    assert found["b.py"].mode == 0o644
    assert found["a"].mode == 0o755


def test_a_link_inside_the_tree_is_kept_as_a_link(tmp_path: Path) -> None:
    write(tmp_path, {"src/model.py": "m\n", "conf/base.yaml": "a: 1\n"})
    (tmp_path / "model.py").symlink_to("src/model.py")
    (tmp_path / "src/conf").symlink_to(tmp_path / "conf")  # absolute, but inside
    found = members(pack(tmp_path).data)
    assert found["model.py"].issym() and found["model.py"].linkname == "src/model.py"
    assert found["src/conf"].issym() and found["src/conf"].linkname == "../conf"
    assert "src/conf/base.yaml" not in found  # the link is not followed


def test_a_link_leaving_the_tree_is_refused(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    write(tree, {"train.py": ""})
    (tmp_path / "secret").write_text("s")
    (tree / "data").symlink_to("../secret")
    with pytest.raises(CodeArchiveError, match=r"^data: a link to \.\./secret, outside"):
        pack(tree)
    (tree / "data").unlink()
    (tree / "etc").symlink_to("/etc")
    with pytest.raises(CodeArchiveError, match=r"^etc: a link to /etc, outside"):
        pack(tree)


def test_an_ignored_outside_link_is_no_problem(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": "", ".etrainignore": "data\n"})
    (tmp_path / "data").symlink_to("/etc")
    assert names(pack(tmp_path).data) == [".etrainignore", "train.py"]


def test_a_fifo_is_refused_by_name(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": ""})
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CodeArchiveError, match=r"^pipe: not a regular file"):
        pack(tmp_path)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CodeArchiveError, match="not a directory"):
        pack(tmp_path / "nowhere")
