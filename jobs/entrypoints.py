"""What can be checked of an entrypoint (``package.module:function``) at submission without
running a line of it: its module's source is found and read on the service's own path, never
imported (importing runs code), parsed, and must bind the function's name at its top level.
A module the service cannot see may still be on the workers: it is left to them."""

from __future__ import annotations

import ast
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
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except SyntaxError as e:
        return f"module {module!r} does not parse: {e.msg} (line {e.lineno})"
    names = top_level_names(tree)
    if "*" in names or "__getattr__" in names:
        return None  # a star import or a module __getattr__ may bind it: the workers tell
    if function not in names:
        return f"module {module!r} defines no {function!r}"
    return None
