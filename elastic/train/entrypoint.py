"""A job's training loop, named by its entrypoint (``module:function``), as a worker finds it,
and the one line of a worker's error that the job's event log shows."""

from __future__ import annotations

import importlib
from typing import Any


def last_line(text: str) -> str:
    """The last non-blank line of an error's text (whose first lines may be a traceback)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class EntrypointError(RuntimeError):
    """The entrypoint cannot be loaded (its module does not import, or has no such name):
    the same on every worker and every attempt, so the job fails at once."""


def resolve(entrypoint: str) -> Any:
    """The object an entrypoint ``module:name`` names, its module imported."""
    module, _, name = entrypoint.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise EntrypointError(f"cannot load {entrypoint}: {type(e).__name__}: {e}") from e
