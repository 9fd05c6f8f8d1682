"""An entrypoint is checked at submission from its source, never imported; at the workers,
one that cannot load fails the job at once (no restart can help)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastic.train.entrypoint import EntrypointError, resolve
from jobs.entrypoints import find_source, problem


def tree(root: Path) -> list[str]:
    pkg = root / "mypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('importing runs code: never here')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "loops.py").write_text(
        "import os\nfrom math import sqrt as root\nRATE: float = 0.1\n"
        "def train_loop(config, ctx):\n    pass\n"
        "async def later():\n    pass\nclass Trainer:\n    pass\na, (b, c) = 1, (2, 3)\n"
    )
    (pkg / "broken.py").write_text("def train_loop(:\n")
    (pkg / "star.py").write_text("from os.path import *\n")
    return [str(root)]


def test_a_module_is_found_on_the_path_without_being_imported(tmp_path: Path) -> None:
    path = tree(tmp_path)
    assert find_source("mypkg.loops", path) == tmp_path / "mypkg" / "loops.py"
    assert find_source("mypkg.sub", path) == tmp_path / "mypkg" / "sub" / "__init__.py"
    assert find_source("mypkg.nothere", path) is None
    assert "mypkg" not in sys.modules


def test_the_function_must_be_bound_at_the_modules_top_level(tmp_path: Path) -> None:
    path = tree(tmp_path)
    for name in ("train_loop", "later", "Trainer", "RATE", "os", "root", "a", "b", "c"):
        assert problem(f"mypkg.loops:{name}", path) is None, name
    assert problem("mypkg.loops:trian_loop", path) == "module 'mypkg.loops' defines no 'trian_loop'"
    assert problem("mypkg.broken:train_loop", path) == (
        "module 'mypkg.broken' does not parse: invalid syntax (line 1)"
    )
    # What the source cannot tell is left to the workers.
    assert problem("mypkg.star:anything", path) is None
    assert problem("elsewhere.module:fn", path) is None


def test_at_the_worker_a_loop_that_cannot_load_is_an_entrypoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree(tmp_path)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("mypkg.loops:train_loop").__name__ == "train_loop"
    cases = {
        "mypkg.loops:trian_loop": "AttributeError",
        "mypkg.nothere:fn": "ModuleNotFoundError",
        "mypkg.broken:train_loop": "SyntaxError",
    }
    for entrypoint, kind in cases.items():
        with pytest.raises(EntrypointError, match=f"^cannot load {entrypoint}: {kind}: "):
            resolve(entrypoint)


def test_a_package_loop_is_looked_for_in_the_package_s_archive(tmp_path: Path) -> None:
    import tarfile

    from jobs.entrypoints import problem_in_package

    src = tmp_path / "src"
    (src / "trainer").mkdir(parents=True)
    (src / "train.py").write_text("def train_loop(config, ctx):\n    pass\n")
    (src / "trainer" / "__init__.py").write_text("from .loop import *\n")
    (src / "trainer" / "loop.py").write_text("def train_loop(config, ctx):\n    pass\n")
    (src / "bad.py").write_text("def train_loop(:\n")
    archive = tmp_path / "code.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    assert problem_in_package("train.py:train_loop", archive) is None
    assert problem_in_package("trainer.loop:train_loop", archive) is None
    assert problem_in_package("trainer:train_loop", archive) is None  # a star import: unknown
    assert problem_in_package("train.py:train_lop", archive) == "train.py defines no 'train_lop'"
    assert problem_in_package("bad.py:train_loop", archive) == (
        "bad.py does not parse: invalid syntax (line 1)"
    )
    assert problem_in_package("other.py:f", archive) == (
        "the code package has no other.py (for 'other.py')"
    )
    assert problem_in_package("a.b:f", archive) == (
        "the code package has no a/b.py or a/b/__init__.py (for 'a.b')"
    )


def test_a_loop_must_take_no_arguments_or_config_and_ctx(tmp_path: Path) -> None:
    source = (
        "def main():\n    pass\n"
        "def train_loop(config, ctx, extra=1):\n    pass\n"
        "def spread(*args):\n    pass\n"
        "def one(ctx):\n    pass\n"
        "async def three(a, b, /, c):\n    pass\n"
    )
    (tmp_path / "loops.py").write_text(source)
    for name in ("main", "train_loop", "spread"):
        assert problem(f"loops:{name}", [str(tmp_path)]) is None, name
    assert problem("loops:one", [str(tmp_path)]) == (
        "one() takes 1 required argument: a loop takes either no arguments "
        "(see elastic.train.get_context) or (config, ctx)"
    )
    assert "three() takes 3 required arguments" in str(problem("loops:three", [str(tmp_path)]))
