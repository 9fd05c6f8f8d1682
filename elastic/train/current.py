"""How a training loop is called, and the context of the one running in this process.

A loop is ``train_loop(config, ctx)``, or a function of no arguments written as a script's
``main()``: it reads its flags from ``sys.argv`` (the job's ``hyperparameters.args``) and
gets its context from :func:`get_context`, so a script's ``def main():`` and its argparse
stay as they are."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.train.context import TrainContext

_current: list[TrainContext] = []

ARITY_RULE = "takes either no arguments (see elastic.train.get_context) or (config, ctx)"


def get_context() -> TrainContext:
    """The context of the loop this process runs (its model, data and steps)."""
    if not _current:
        raise RuntimeError(
            "no training context in this process: get_context() works inside a job's loop "
            "(etrain submit job.yaml --code ., or etrain run-local job.yaml --code .)"
        )
    return _current[-1]


def required_arguments(train_loop: Callable[..., Any]) -> int | None:
    """How many arguments ``train_loop`` must be given; None when it takes any number."""
    try:
        parameters = inspect.signature(train_loop).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(
        1
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def arity_problem(train_loop: Callable[..., Any], needed: int | None = None) -> str | None:
    needed = required_arguments(train_loop) if needed is None else needed
    if needed in (None, 0, 2):
        return None
    name = getattr(train_loop, "__name__", repr(train_loop))
    return f"{name} must take no arguments or (config, ctx), not {needed}: it {ARITY_RULE}"


def loop_argv(config: dict[str, Any], program: str) -> list[str]:
    """``sys.argv`` for a loop: the file it is in, then ``hyperparameters.args``."""
    args = (config.get("hyperparameters") or {}).get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise TypeError(f"hyperparameters.args must be a list of strings, not {args!r}")
    return [program, *args]


@contextmanager
def current(ctx: TrainContext) -> Iterator[TrainContext]:
    _current.append(ctx)
    try:
        yield ctx
    finally:
        _current.remove(ctx)


def call_train_loop(
    train_loop: Callable[..., Any], config: dict[str, Any], ctx: TrainContext
) -> Any:
    """``train_loop`` called as it is written, with ``ctx`` current and, for a loop of no
    arguments, ``sys.argv`` set as a script's would be."""
    needed = required_arguments(train_loop)  # the signature, read once
    problem = arity_problem(train_loop, needed)
    if problem is not None:
        raise TypeError(problem)
    with current(ctx):
        if needed == 2:
            return train_loop(config, ctx)
        saved = sys.argv
        sys.argv = loop_argv(config, _program(train_loop))
        try:
            return train_loop()
        finally:
            sys.argv = saved


def _program(train_loop: Callable[..., Any]) -> str:
    """The file a loop is written in: a script's ``sys.argv[0]``."""
    try:
        return inspect.getsourcefile(train_loop) or str(train_loop.__name__)
    except (TypeError, AttributeError):
        return "loop"
