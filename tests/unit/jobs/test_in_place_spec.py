"""The ``fault_tolerance`` option at submission: what it accepts, what it refuses and why."""

from typing import Any

import pytest
from pydantic import ValidationError

from jobs.spec import JobSpec
from tests.conftest import small_job


def job(**top: Any) -> dict[str, Any]:
    data = small_job()
    data.update(top)
    return data


def refusal(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in err.value.errors()]


def test_in_place_is_the_default_where_it_works_and_restart_can_be_chosen() -> None:
    assert JobSpec.model_validate(small_job()).fault_tolerance == "in_place"
    assert JobSpec.model_validate(job(fault_tolerance="restart")).fault_tolerance == "restart"


@pytest.mark.parametrize(
    ("distributed", "scaling"),
    [
        ({"strategy": "fsdp"}, {}),
        ({"sync": "local_sgd", "local_sgd_period": 1}, {}),
        ({"gradient_compression": "fp16"}, {}),
        ({}, {"gpus_per_worker": 1}),
    ],
)
def test_left_out_it_is_restart_where_in_place_cannot_work(
    distributed: dict[str, Any], scaling: dict[str, Any]
) -> None:
    data = job(distributed=distributed)
    data["scaling"].update(scaling)
    spec = JobSpec.model_validate(data)
    assert spec.fault_tolerance == "restart"
    # What the job got is stored with it: the same spec read back keeps it.
    assert JobSpec.model_validate(spec.model_dump()).fault_tolerance == "restart"


@pytest.mark.parametrize(
    ("distributed", "needs"),
    [
        ({"strategy": "fsdp"}, "strategy ddp"),
        ({"sync": "local_sgd", "local_sgd_period": 1}, "sync every_step"),
        ({"gradient_compression": "fp16"}, "gradient_compression none"),
    ],
)
def test_in_place_is_refused_where_it_cannot_work_naming_the_field(
    distributed: dict[str, Any], needs: str
) -> None:
    ((field, message),) = refusal(job(fault_tolerance="in_place", distributed=distributed))
    assert field == "fault_tolerance"
    assert needs in message


def test_in_place_is_refused_for_gpu_workers_naming_the_field() -> None:
    data = job(fault_tolerance="in_place")
    data["scaling"]["gpus_per_worker"] = 1
    ((field, message),) = refusal(data)
    assert field == "fault_tolerance"
    assert "gpus_per_worker" in message


def test_an_unknown_mode_is_refused() -> None:
    ((field, _),) = refusal(job(fault_tolerance="hot_spare"))
    assert field == "fault_tolerance"
