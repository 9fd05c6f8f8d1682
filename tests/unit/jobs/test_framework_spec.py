"""A command job's ``framework``: checked at submission, carried to every worker."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from elastic.train.command import CommandPlan
from jobs.launcher import command_plan
from jobs.spec import JobSpec
from tests.conftest import small_job


def errors(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"name": "script", **data})
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in err.value.errors()]


def test_a_command_job_is_pytorch_unless_it_says_tensorflow() -> None:
    plain = JobSpec.model_validate({"name": "script", "command": ["python", "train.py"]})
    assert plain.framework == "pytorch"
    tf = JobSpec.model_validate(
        {"name": "script", "command": ["python", "train.py"], "framework": "tensorflow"}
    )
    assert tf.framework == "tensorflow"
    # Stored and read back, it is the same job.
    assert JobSpec.model_validate(tf.model_dump(mode="json")) == tf


def test_an_unknown_framework_is_refused_with_the_known_ones() -> None:
    for value in ("jax", "TensorFlow", "horovod", ""):
        assert errors({"command": ["python"], "framework": value}) == [
            (
                "framework",
                f"unknown framework {value!r}: use one of pytorch, tensorflow (for a Horovod "
                "script, see docs/horovod.md)",
            )
        ]
    assert [f for f, _ in errors({"command": ["python"], "framework": 3})] == ["framework"]


def test_tensorflow_without_a_command_is_refused_and_pytorch_is_any_jobs() -> None:
    assert errors({**small_job(), "framework": "tensorflow"}) == [
        (
            "framework",
            "framework sets up a command job's processes: give command, e.g. "
            '["python", "train.py"]',
        )
    ]
    # Every stored spec says pytorch: a built-in job's reads back.
    builtin = JobSpec.model_validate({**small_job(), "framework": "pytorch"})
    assert builtin.framework == "pytorch"
    assert JobSpec.model_validate(builtin.model_dump(mode="json")) == builtin


def test_the_framework_reaches_the_workers_plan() -> None:
    spec = JobSpec.model_validate(
        {"name": "script", "command": ["python", "train.py"], "framework": "tensorflow"}
    )
    plan = CommandPlan.from_dict(command_plan("job-1", spec, "/ckpt", "alice"))
    assert plan.framework == "tensorflow"
    assert plan.argv == ["python", "train.py"]
