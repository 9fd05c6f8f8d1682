"""The API under fuzzing, against a real server on real Ray: Schemathesis walks the live
/openapi.json with a valid token (no 5xx, every response matches the schema), and
Hypothesis sends invalid job specs (each is a 4xx naming its field, none makes a job).
Bounded and derandomized so CI is reproducible."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from elastic.cluster.scheduling import PRIORITY_CLASSES
from elastic.job_state import TERMINAL_STATES
from jobs.spec import ENTRYPOINT_PATTERN, JobSpec
from jobs.workloads import WORKLOADS
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from tests.conftest import TOKEN, LiveServer, make_settings, small_job

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def fuzz_server(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # No rate limit here: the fuzzer is the only client and must see real answers.
    settings = make_settings(tmp_path_factory.mktemp("fuzz"), rate_limit_per_s=0)
    with LiveServer(settings) as live:
        yield live


@pytest.fixture
def api_schema(fuzz_server: LiveServer) -> Any:
    schemathesis.experimental.OPEN_API_3_1.enable()  # FastAPI writes OpenAPI 3.1
    return schemathesis.from_uri(f"{fuzz_server.url}/openapi.json", base_url=fuzz_server.url)


# /v1/events is a stream that never ends on its own; its auth is walked elsewhere.
schema = schemathesis.from_pytest_fixture("api_schema", endpoint="^(?!/v1/events$)")


@schema.parametrize()
@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_breaks_the_api_or_its_schema(case: Any, fuzz_server: LiveServer) -> None:
    response = case.call_and_validate(
        headers=AUTH, timeout=30, checks=(not_a_server_error, response_schema_conformance)
    )
    if case.path == "/v1/jobs" and case.method == "POST" and response.status_code in (200, 201):
        with fuzz_server.client() as client:  # an accepted job must not train for long
            job = response.json()
            if client.get(f"/v1/jobs/{job['id']}").json()["state"] not in TERMINAL_STATES:
                client.post(f"/v1/jobs/{job['id']}/cancel")


def _not_int_text() -> st.SearchStrategy[str]:
    return st.text(max_size=8).filter(lambda s: not s.strip().lstrip("+-").isdigit())


# The values a spec may name, read from the models that accept them: a generator of invalid
# values must never draw one of these (derandomisation only hid that it could).
VALID_MODELS = set(get_args(ImageClassificationHyperparameters.model_fields["model"].annotation))


def not_a_workload(s: str) -> bool:
    # A 'package.module:function' string is a valid spec: the server's entrypoint allow-list
    # refuses it later, so the spec-level generator must not draw one.
    return s not in WORKLOADS and not ENTRYPOINT_PATTERN.match(s)


def not_a_model(s: str) -> bool:
    return s not in VALID_MODELS


# For each field, values it must refuse (none of them is valid, in any combination).
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "name": st.one_of(
        st.just(""),
        st.text(alphabet=";$`|&<>(){}/\\!\n", min_size=1),
        st.text(alphabet="ab", min_size=129, max_size=140),
        st.integers(),
    ),
    "workload": st.text(max_size=40).filter(not_a_workload),
    "scaling.min_workers": st.one_of(
        st.integers(max_value=0), st.integers(min_value=1025), _not_int_text(), st.none()
    ),
    "scaling.max_workers": st.one_of(st.integers(max_value=0), st.integers(min_value=1025)),
    "scaling.cpus_per_worker": st.one_of(
        st.floats(max_value=0, allow_nan=False, allow_infinity=False),
        st.floats(min_value=512.001, max_value=1e9),
    ),
    "scaling.gpus_per_worker": st.one_of(st.integers(max_value=-1), st.integers(min_value=17)),
    "checkpoint.every_steps": st.one_of(
        st.integers(max_value=0), st.integers(min_value=10_000_001)
    ),
    "checkpoint.keep": st.one_of(st.integers(max_value=0), st.integers(min_value=1001)),
    "failure.max_restarts": st.one_of(st.integers(max_value=-1), st.integers(min_value=10_001)),
    "failure.min_workers_grace_s": st.floats(max_value=-0.001, allow_infinity=False),
    "hyperparameters.max_steps": st.one_of(
        st.integers(max_value=0), st.integers(min_value=100_000_001)
    ),
    "hyperparameters.global_batch_size": st.integers(max_value=0),
    "hyperparameters.learning_rate": st.one_of(
        st.floats(max_value=0, allow_infinity=False), st.floats(min_value=100.001, max_value=1e12)
    ),
    "hyperparameters.model": st.text(max_size=12).filter(not_a_model),
    "hyperparameters.unknown_knob": st.integers(),
    "priority": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=1001),
        st.text(max_size=10).filter(lambda s: s not in PRIORITY_CLASSES),
        st.booleans(),
        st.floats(allow_nan=False),
        st.none(),
    ),
    "surprise": st.integers(),
}


def _with(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    out = {**body}
    node = out
    for p in parents:
        node[p] = {**node.get(p, {})}
        node = node[p]
    node[leaf] = value
    return out


@st.composite
def invalid_spec(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    field = draw(st.sampled_from(sorted(INVALID)))
    return field, _with(small_job(), field, draw(INVALID[field]))


def test_the_invalid_generators_exclude_every_valid_value() -> None:
    assert {"image-classification", "text-classification"} <= set(WORKLOADS)
    assert not any(not_a_workload(w) for w in WORKLOADS)
    assert not not_a_workload("A:A")  # the shape a random draw found: a valid entrypoint
    assert {"resnet18", "resnet34", "small_cnn"} <= VALID_MODELS
    assert not any(not_a_model(m) for m in VALID_MODELS)


@given(invalid_spec())
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_generated_spec_is_invalid_in_its_field(case: tuple[str, dict[str, Any]]) -> None:
    """Random (not derandomised) draws, checked by the spec model itself: what the server
    test below sends is invalid by construction, not by luck of the seed. Limits that need
    the cluster (none of these fields' bounds do) are the server's."""
    field, body = case
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(body)
    named = {".".join(str(p) for p in e["loc"]) for e in refused.value.errors()}
    assert any(n == field or n.startswith(field + ".") for n in named), (field, named)


def test_every_invalid_spec_is_a_4xx_naming_its_field(fuzz_server: LiveServer) -> None:
    client = fuzz_server.client()
    before = len(client.get("/v1/jobs", params={"limit": 500}).json()["items"])

    @given(invalid_spec())
    @settings(
        max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    def submit(case: tuple[str, dict[str, Any]]) -> None:
        field, body = case
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 422, (field, body, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        named = [e["field"] for e in r.json()["errors"]]
        assert field in named, (field, named, body)

    try:
        submit()
    finally:
        after = client.get("/v1/jobs", params={"limit": 500}).json()["items"]
        client.close()
    assert len(after) == before


def test_a_body_that_is_not_a_spec_is_a_4xx(fuzz_server: LiveServer) -> None:
    @given(
        st.one_of(
            st.binary(max_size=64),
            st.lists(st.integers(), max_size=4).map(
                lambda x: httpx.Request("POST", "/", json=x).content
            ),
        )
    )
    @settings(
        max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    def submit(body: bytes) -> None:
        with fuzz_server.client() as client:
            r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, r.text
        assert r.headers["content-type"] == "application/problem+json"
        if r.status_code == 422:
            assert r.json()["errors"]

    submit()
