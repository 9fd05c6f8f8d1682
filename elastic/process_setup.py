"""Set-up of every Ray worker process, before Ray runs anything in it: Ray's worker process
set-up hook, named in the environment a Ray instance starts with (``jobs.launcher.
worker_setup``: the embedded Ray, the test suite's cluster, the Helm chart's Ray pods).
Imports nothing at module level: a hook that fails to import ends every worker."""

from __future__ import annotations

from typing import Any

# Ray's worker process imports and calls it at start ("module.function"), when it is named
# in the environment under ``ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``.
SETUP_HOOK = "elastic.process_setup.lean_serialization"


def lean_serialization() -> None:
    """Ray's serialization context, made when a process receives its first argument,
    registers serializers for FastAPI's pydantic fields, Starlette's ``State`` and Arrow's
    tables (``ray.util.serialization_addons.apply``), importing pydantic, Starlette,
    pyarrow and numpy to do so: 25 MB of every worker process, a third of a job's
    supervisor. No process of ours sends those types, so the context is made without them
    (a pydantic model, for one, is pickled as any object is)."""
    from ray.util import serialization_addons

    serialization_addons.apply = _no_addons


def _no_addons(serialization_context: Any) -> None:
    return None
