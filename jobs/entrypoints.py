"""What can be checked of an entrypoint (``package.module:function``) at submission without
running a line of it: its module's source is found and read on the service's own path, never
imported (importing runs code), parsed, and must bind the function's name at its top level.
A module the service cannot see may still be on the workers: it is left to them. A loop of
a code package is looked for in the package, where it must be."""

from __future__ import annotations

import ast
import tarfile
from collections.abc import Iterable
from pathlib import Path


def find_source(module: str, search_path: Iterable[str]) -> Path | None:
    """The file ``module`` would be imported from (a ``.py`` file or a package's
    ``__init__.py``), looked up on ``search_path`` without importing anything."""
    parts = module.split(".")
    for entry in search_path:
        base = Path(entry or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level: functions, classes, assignments, imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def problem(entrypoint: str, search_path: Iterable[str]) -> str | None:
    """Why ``entrypoint`` cannot load, as far as its source tells; None when it may."""
    module, _, function = entrypoint.partition(":")
    source = find_source(module, search_path)
    if source is None:
        return None
    return problem_in_source(f"module {module!r}", source.read_bytes(), function)


def problem_in_source(what: str, source: bytes, function: str) -> str | None:
    """Why ``source`` (``what``, as a message names it) cannot give ``function``."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"{what} does not parse: {e.msg} (line {e.lineno})"
    names = top_level_names(tree)
    if "*" in names or "__getattr__" in names:
        return None  # a star import or a module __getattr__ may bind it: the workers tell
    if function not in names:
        return f"{what} defines no {function!r}"
    return arity_problem(tree, function)


def arity_problem(tree: ast.Module, function: str) -> str | None:
    """A top-level ``def function`` must take no arguments (a script's ``main()``, which
    gets its context from ``elastic.train.get_context``) or ``(config, ctx)``: the two ways
    a worker calls a loop."""
    defs = [
        node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
    ]
    if not defs:
        return None  # bound another way (an assignment, an import): the workers tell
    args = defs[-1].args
    if args.vararg is not None:
        return None
    positional = [*args.posonlyargs, *args.args]
    required = len(positional) - len(args.defaults)
    if required in (0, 2):
        return None
    return (
        f"{function}() takes {required} required argument{'s' if required != 1 else ''}: a "
        "loop takes either no arguments (see elastic.train.get_context) or (config, ctx)"
    )


def package_members(entrypoint: str) -> list[str]:
    """Where in a code package an entrypoint's source may be, first found first: the file
    it names (``train.py:train_loop``), or its module's file or package."""
    where = entrypoint.rpartition(":")[0]
    if where.endswith(".py"):
        return [where]
    base = where.replace(".", "/")
    return [f"{base}.py", f"{base}/__init__.py"]


def problem_in_package(entrypoint: str, archive: Path) -> str | None:
    """Why a code package (a checked ``.tar.gz``) cannot give ``entrypoint``; None when it
    may. Its source is read from the archive, never run."""
    where, _, function = entrypoint.rpartition(":")
    wanted = package_members(entrypoint)
    with tarfile.open(archive, mode="r:gz") as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        for name in wanted:
            member = members.get(name)
            if member is not None:
                stream = tar.extractfile(member)
                assert stream is not None
                return problem_in_source(name, stream.read(), function)
    return f"the code package has no {' or '.join(wanted)} (for {where!r})"
