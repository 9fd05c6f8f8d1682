import copy
from typing import Any

import pytest
from pydantic import ValidationError

from jobs.spec import JobSpec, priority_value
from tests.conftest import small_job

PRIORITY_MESSAGE = "must be one of low, normal, high or an integer from 0 to 1000"


def errors_of(patch: dict[str, Any]) -> list[tuple[str, str]]:
    data = copy.deepcopy(small_job())
    for key, value in patch.items():
        target = data
        *path, last = key.split(".")
        for p in path:
            target = target[p]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in err.value.errors()]


def test_the_readme_example_is_valid_and_normalised() -> None:
    spec = JobSpec.model_validate(small_job())
    assert spec.scaling.backend == "gloo"
    assert spec.hyperparameters["model"] == "small_cnn"
    assert spec.hyperparameters["momentum"] == 0.9  # defaults filled in
    assert spec.failure.max_restarts == 3
    assert spec.scaling.worker_resources() == {"CPU": 1.0}


def test_gpus_mean_nccl() -> None:
    data = small_job()
    data["scaling"]["gpus_per_worker"] = 1
    spec = JobSpec.model_validate(data)
    assert spec.scaling.backend == "nccl"
    assert spec.scaling.worker_resources() == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize(
    "patch,expected",
    [
        (
            {"scaling.min_workers": 3},
            [("scaling.min_workers", "min_workers (3) must not exceed max_workers (2)")],
        ),
        (
            {"workload": "nope"},
            [
                (
                    "workload",
                    "unknown workload 'nope': use one of "
                    "image-classification, text-classification or a "
                    "'package.module:function' entrypoint",
                )
            ],
        ),
        (
            {"workload": "os:system; rm -rf /"},
            [
                (
                    "workload",
                    "unknown workload "
                    "'os:system; rm -rf /': use one of "
                    "image-classification, text-classification "
                    "or a 'package.module:function' "
                    "entrypoint",
                )
            ],
        ),
        (
            {"hyperparameters.learning_rate": -0.1},
            [("hyperparameters.learning_rate", "Input should be greater than 0")],
        ),
        (
            {"hyperparameters.max_steps": ...},
            [
                (
                    "hyperparameters.max_steps",
                    "give epochs or max_steps (or both: the run stops at the first)",
                )
            ],
        ),
        (
            {"hyperparameters.dataset": "imagefolder"},
            [("hyperparameters.data_path", "data_path is required for dataset 'imagefolder'")],
        ),
        (
            {"hyperparameters.model": "gpt5"},
            [
                (
                    "hyperparameters.model",
                    "Input should be 'resnet18', 'resnet34', 'resnet50', "
                    "'mobilenet_v3_small', 'efficientnet_b0' or 'small_cnn'",
                )
            ],
        ),
        (
            {"hyperparameters.dataset": "cifar10"},
            [("hyperparameters.data_path", "data_path is required for dataset 'cifar10'")],
        ),
        (
            {"hyperparameters.global_batch_size": 1},
            [
                (
                    "hyperparameters.global_batch_size",
                    "global_batch_size (1) must be at least max_workers (2) so that every worker "
                    "gets a sample",
                )
            ],
        ),
        ({"hyperparameters.lr": 0.1}, [("hyperparameters.lr", "Extra inputs are not permitted")]),
        (
            {"scaling.min_workers": 0},
            [("scaling.min_workers", "Input should be greater than or equal to 1")],
        ),
        (
            {"scaling.gpus_per_worker": -1},
            [("scaling.gpus_per_worker", "Input should be greater than or equal to 0")],
        ),
        (
            {"checkpoint.every_steps": 0},
            [("checkpoint.every_steps", "Input should be greater than or equal to 1")],
        ),
        (
            {"failure": {"max_restarts": -1}},
            [("failure.max_restarts", "Input should be greater than or equal to 0")],
        ),
        ({"name": ""}, [("name", "String should have at least 1 character")]),
        *(
            ({"priority": bad}, [("priority", PRIORITY_MESSAGE)])
            for bad in ("urgent", "100", 1001, -1, True, 50.5, None, [100])
        ),
        ({"urgency": 1}, [("urgency", "Extra inputs are not permitted")]),
    ],
)
def test_each_rejection_names_its_field(patch: dict[str, Any], expected: list) -> None:
    assert errors_of(patch) == expected


@pytest.mark.parametrize(
    "given,number", [("low", 0), ("normal", 50), ("high", 100), (0, 0), (51, 51), (1000, 1000)]
)
def test_a_priority_is_a_class_or_a_number_and_kept_as_given(given: Any, number: int) -> None:
    spec = JobSpec.model_validate({**small_job(), "priority": given})
    assert (spec.priority, spec.priority_value) == (given, number)
    assert spec.model_dump(mode="json")["priority"] == given


def test_a_job_without_a_priority_is_normal() -> None:
    spec = JobSpec.model_validate(small_job())
    assert (spec.priority, spec.priority_value) == ("normal", 50)
    assert priority_value(None) == 50  # a spec stored before priorities existed


def test_a_custom_entrypoint_keeps_free_hyperparameters() -> None:
    data = small_job()
    data["workload"] = "mypackage.train:loop"
    data["hyperparameters"] = {"anything": [1, 2]}
    spec = JobSpec.model_validate(data)
    assert spec.is_custom
    assert spec.hyperparameters == {"anything": [1, 2]}


def test_a_body_that_is_not_json_is_named_as_the_body_not_as_a_character_offset() -> None:
    from jobs.validation import describe

    error = {
        "type": "json_invalid",
        "loc": ("body", 1),
        "msg": "JSON decode error",
        "ctx": {"error": "Expecting property name enclosed in double quotes"},
    }
    assert describe([error]) == [
        {
            "field": "(body)",
            "message": "not valid JSON (at character 1: "
            "Expecting property name enclosed in double quotes)",
        }
    ]


PACKAGE = "ab" * 32


def command_errors(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"name": "script", **data})
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in err.value.errors()]


def test_a_command_job_runs_its_command_and_recovers_by_restart() -> None:
    spec = JobSpec.model_validate(
        {"name": "script", "command": ["python", "train.py", "--epochs", "3"], "code": PACKAGE}
    )
    assert spec.workload == "command"
    assert spec.command == ["python", "train.py", "--epochs", "3"]
    assert spec.code == PACKAGE
    assert spec.fault_tolerance == "restart"
    assert spec.stop_grace_s == 30.0
    assert not spec.is_custom
    # Stored and read back, it is the same job.
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_a_job_names_one_program_and_a_package_runs_a_command_or_its_own_loop() -> None:
    assert command_errors({}) == [
        (
            "workload",
            "missing: give a workload (built-in or 'package.module:function') or a command",
        )
    ]
    assert command_errors({"workload": "command"}) == [
        ("command", "missing: workload 'command' runs the spec's command")
    ]
    assert command_errors({"workload": "pkg.mod:fn", "command": ["python"]}) == [
        ("command", "give a workload or a command, not both")
    ]
    assert command_errors({"workload": "image-classification", "code": PACKAGE}) == [
        (
            "code",
            'a code package runs a command (command: ["python", "train.py"]) or a train_loop '
            'of the package (workload: "train.py:train_loop"), not the built-in workload '
            "'image-classification'",
        )
    ]
    assert command_errors({"workload": "../train.py:loop", "code": PACKAGE}) == [
        (
            "workload",
            "'../train.py:loop' is not a train_loop of the package: name a file and function "
            "('train.py:train_loop') or a module of the package and function "
            "('trainer.loop:train_loop')",
        )
    ]
    assert command_errors({"entrypoint": "train.py:loop", "workload": "a:b"}) == [
        ("entrypoint", "give entrypoint or workload, not both")
    ]
    assert command_errors({"workload": "a:b", "requirements": ["numpy"]}) == [
        (
            "requirements",
            "requirements are installed for a job's code package: give code (etrain submit "
            "--code DIR), or install them on the workers",
        )
    ]
    assert command_errors(
        {"entrypoint": "loop.py:main", "code": PACKAGE, "hyperparameters": {"args": ["-n", 3]}}
    ) == [("hyperparameters.args", "a loop's arguments (its sys.argv) are a list of strings")]
    loop = JobSpec.model_validate(
        {"name": "x", "entrypoint": "src/train.py:loop", "code": PACKAGE, "requirements": ["a"]}
    )
    assert (loop.workload, loop.runs_package_loop, loop.is_custom) == (
        "src/train.py:loop",
        True,
        False,
    )
    # A package loop recovers by restart unless it asks for in place, which its options
    # must allow, as a built-in's do.
    assert loop.recovery_mode == "restart"
    for asked in ("in_place", "restart"):
        chosen = JobSpec.model_validate(
            {"name": "x", "entrypoint": "t.py:f", "code": PACKAGE, "fault_tolerance": asked}
        )
        assert chosen.recovery_mode == asked
    # ... and by restart where they do not, asked for in place or not.
    fsdp = {"entrypoint": "t.py:f", "code": PACKAGE, "distributed": {"strategy": "fsdp"}}
    assert JobSpec.model_validate({"name": "x", **fsdp}).recovery_mode == "restart"
    assert command_errors({**fsdp, "fault_tolerance": "in_place"})[0][0] == "fault_tolerance"
    assert command_errors({"command": ["python"], "fault_tolerance": "in_place"}) == [
        (
            "fault_tolerance",
            "a command job recovers by restart: its processes start again at the new size and "
            "resume from their own checkpoint (torchrun's elastic contract)",
        )
    ]
    assert [f for f, _ in command_errors({"command": []})] == ["command"]
    assert [f for f, _ in command_errors({"command": ["a\x00b"]})] == ["command.0"]
    assert [f for f, _ in command_errors({"command": ["python"], "code": "../x"})] == ["code"]
    assert [f for f, _ in command_errors({"command": ["p"], "stop_grace_s": -1})] == [
        "stop_grace_s"
    ]
