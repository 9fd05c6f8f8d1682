"""Job files (YAML or JSON) and the ``--set path=value`` overrides applied to them."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any


class JobFileError(ValueError):
    """A job file or an override that cannot be used; the message names what is wrong."""


def load(path: str) -> dict[str, Any]:
    """The spec in ``path`` (``-``: standard input): JSON for ``.json``, else YAML (which
    also reads JSON)."""
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise JobFileError(f"{path}: {e.strerror or e}") from None
    try:
        spec = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except ValueError as e:  # json's message has the position on its first line
        raise JobFileError(f"{path}: not valid JSON: {_first_line(e)}") from None
    except yaml.YAMLError as e:
        raise JobFileError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(spec, dict):
        raise JobFileError(
            f"{path}: a job spec is a mapping (name, workload, ...), not {type(spec).__name__}"
        )
    return spec


def parse_override(text: str) -> tuple[list[str], Any]:
    """``hyperparameters.learning_rate=0.01`` -> (["hyperparameters", "learning_rate"], 0.01);
    the value is read as YAML, so ``2`` is a number, ``true`` a boolean, ``[1, 2]`` a list,
    and ``'2'`` a string."""
    import yaml

    path, sep, raw = text.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise JobFileError(
            f"{text!r}: expected a dotted path, '=' and a value, "
            "e.g. hyperparameters.learning_rate=0.01"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise JobFileError(
            f"{path}: the value {raw!r} is not valid YAML: {_yaml_problem(e)}"
        ) from None
    return keys, value


def apply_overrides(spec: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``spec`` with each override set, creating the mappings on its path."""
    result = copy.deepcopy(spec)
    for text in overrides:
        keys, value = parse_override(text)
        node = result
        for i, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                where = ".".join(keys[: i + 1])
                raise JobFileError(
                    f"{where}: is {child!r}, not a mapping; cannot set {'.'.join(keys)}"
                )
            node = child
        node[keys[-1]] = value
    return result


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _yaml_problem(error: Exception) -> str:
    """PyYAML's error in one line, with where it is: its message spreads over four lines
    (what it was reading, where that began, the problem, where it is), and the first alone
    ("while scanning a simple key") says neither what went wrong nor where."""
    problem_mark = getattr(error, "problem_mark", None)
    if problem_mark is None:
        return _first_line(error)
    problem = getattr(error, "problem", None) or _first_line(error)
    text = f"{_position(problem_mark)}: {problem}"
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context:
        began = "" if context_mark is None else f" at {_position(context_mark)}"
        text += f" ({context}{began})"
    return text


def _position(mark: Any) -> str:
    """A PyYAML mark as an editor counts: lines and columns from 1 (PyYAML's are from 0)."""
    return f"line {mark.line + 1}, column {mark.column + 1}"
