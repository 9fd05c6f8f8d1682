"""The ``distributed`` options of a job spec: defaults, backend resolution, and what is
refused at submission because the job's hardware or its other options cannot run it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from elastic.train.distributed import DistributedOptions
from jobs.spec import DistributedSpec, JobSpec
from tests.conftest import small_job


def job(distributed: dict[str, Any], gpus: int = 0, **top: Any) -> dict[str, Any]:
    data = copy.deepcopy(small_job())
    data["distributed"] = distributed
    data["scaling"]["gpus_per_worker"] = gpus
    data.update(top)
    return data


def refusal(data: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    (e,) = err.value.errors()
    return ".".join(str(p) for p in e["loc"]), e["msg"]


def test_defaults_are_synchronous_ddp_in_fp32_and_reach_the_workers_whole() -> None:
    spec = JobSpec.model_validate(small_job())
    assert spec.distributed == DistributedSpec()
    assert spec.train_config() == {
        "hyperparameters": spec.hyperparameters,
        "distributed": {
            "backend": "auto",
            "strategy": "ddp",
            "gradient_compression": "none",
            "powersgd_rank": 1,
            "powersgd_start_step": 2,
            "bucket_cap_mb": 25.0,
            "precision": "fp32",
            "sync": "every_step",
            "local_sgd_period": 8,
        },
    }
    # The worker's view has the same fields and defaults as the spec's.
    assert DistributedOptions.from_dict(spec.train_config()["distributed"]) == DistributedOptions()


@pytest.mark.parametrize(
    "backend,gpus,resolved",
    [
        ("auto", 0, "gloo"),
        ("auto", 1, "nccl"),
        ("gloo", 1, "gloo"),
        ("nccl", 2, "nccl"),
    ],
)
def test_backend_auto_is_nccl_with_gpus_and_can_be_forced(
    backend: str, gpus: int, resolved: str
) -> None:
    assert JobSpec.model_validate(job({"backend": backend}, gpus)).backend == resolved


@pytest.mark.parametrize(
    "distributed,field,starts",
    [
        ({"backend": "nccl"}, "distributed.backend", "nccl needs GPUs"),
        ({"precision": "fp16"}, "distributed.precision", "fp16 needs GPUs"),
        (
            {"strategy": "fsdp", "gradient_compression": "powersgd"},
            "distributed.gradient_compression",
            "gradient compression hooks are DDP's",
        ),
        (
            {"strategy": "fsdp", "sync": "local_sgd", "local_sgd_period": 5},
            "distributed.sync",
            "local_sgd needs every worker to hold the whole model",
        ),
        (
            {"sync": "local_sgd", "gradient_compression": "fp16", "local_sgd_period": 5},
            "distributed.gradient_compression",
            "with local_sgd no gradients are communicated",
        ),
        (
            {"sync": "local_sgd", "local_sgd_period": 4},
            "distributed.local_sgd_period",
            "checkpoint.every_steps (10) must be a multiple of local_sgd_period (4)",
        ),
        (
            {"precision": "tf32"},
            "distributed.precision",
            "Input should be 'fp32', 'bf16' or 'fp16'",
        ),
        (
            {"powersgd_rank": 0},
            "distributed.powersgd_rank",
            "Input should be greater than or equal",
        ),
        ({"bucket_cap_mb": 0}, "distributed.bucket_cap_mb", "Input should be greater than 0"),
        ({"local_sgd": True}, "distributed.local_sgd", "Extra inputs are not permitted"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_field(
    distributed: dict, field: str, starts: str
) -> None:
    loc, message = refusal(job(distributed))
    assert loc == field
    assert starts in message


def test_gpu_only_options_are_accepted_with_gpus() -> None:
    spec = JobSpec.model_validate(job({"backend": "nccl", "precision": "fp16"}, gpus=1))
    assert (spec.backend, spec.distributed.precision) == ("nccl", "fp16")


def test_mixed_precision_with_float64_parameters_is_refused() -> None:
    data = job({"precision": "bf16"})
    data["hyperparameters"]["dtype"] = "float64"
    assert refusal(data) == (
        "distributed.precision",
        "precision bf16 with hyperparameters.dtype float64: mixed precision needs float32 "
        "parameters",
    )


def test_local_sgd_with_a_period_that_divides_the_checkpoint_interval() -> None:
    spec = JobSpec.model_validate(job({"sync": "local_sgd", "local_sgd_period": 5}))
    assert spec.distributed.local_sgd_period == 5
