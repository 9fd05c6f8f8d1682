"""How a worker starts a confined child that runs a module of ``elastic`` (a package
loop's child, in either mode): with the very ``elastic`` package the worker runs, found by
its directory, which the child may read, not by the import path: an editable install's
finder may name another checkout, one the child may not read."""

from __future__ import annotations

import sys
from pathlib import Path

# The child's first lines (see the module's docstring).
_BOOT = """import importlib.util, runpy, sys
package, module = sys.argv.pop(1), sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "elastic", package + "/__init__.py", submodule_search_locations=[package]
)
sys.modules["elastic"] = loaded = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loaded)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def child_argv(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this process's ``elastic`` package (see _BOOT)."""
    import elastic

    package = str(Path(elastic.__file__).resolve().parent)
    return [sys.executable, "-c", _BOOT, package, module, *args]
