"""What a command job's process gets for its framework: TensorFlow's TF_CONFIG."""

from __future__ import annotations

import json

import pytest

from elastic.train.command import CommandPlan
from elastic.train.command_env import (
    FRAMEWORKS,
    NEEDS_ENDPOINTS,
    endpoint,
    framework_variables,
    tf_config,
)


def test_each_worker_is_a_tensorflow_worker_indexed_by_its_rank() -> None:
    endpoints = [("10.0.0.5", 41000), ("10.0.0.6", 42001), ("10.0.0.5", 41002)]
    configs = [json.loads(tf_config(rank, endpoints)) for rank in range(3)]
    cluster = {"worker": ["10.0.0.5:41000", "10.0.0.6:42001", "10.0.0.5:41002"]}
    assert configs == [
        {"cluster": cluster, "task": {"type": "worker", "index": 0}},
        {"cluster": cluster, "task": {"type": "worker", "index": 1}},
        {"cluster": cluster, "task": {"type": "worker", "index": 2}},
    ]


def test_one_worker_is_a_cluster_of_one() -> None:
    assert json.loads(tf_config(0, [("127.0.0.1", 5000)])) == {
        "cluster": {"worker": ["127.0.0.1:5000"]},
        "task": {"type": "worker", "index": 0},
    }


def test_an_ipv6_address_is_bracketed_as_grpc_reads_it() -> None:
    assert endpoint("fd00::7", 2222) == "[fd00::7]:2222"
    assert endpoint("node-3.internal", 2222) == "node-3.internal:2222"
    assert json.loads(tf_config(1, [("fd00::6", 1), ("fd00::7", 2)]))["cluster"] == {
        "worker": ["[fd00::6]:1", "[fd00::7]:2"]
    }


def test_a_rank_outside_the_cluster_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 workers"):
        tf_config(2, [("a", 1), ("b", 2)])


def test_pytorch_adds_nothing_to_torchruns_variables_and_needs_no_ports() -> None:
    assert FRAMEWORKS == ("pytorch", "tensorflow")
    assert sorted(NEEDS_ENDPOINTS) == ["tensorflow"]
    assert framework_variables("pytorch", 3, []) == {}


def test_tensorflow_adds_tf_config_alone() -> None:
    variables = framework_variables("tensorflow", 1, [("h0", 7000), ("h1", 7001)])
    assert list(variables) == ["TF_CONFIG"]
    assert json.loads(variables["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


def test_an_unknown_framework_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown framework 'jax': one of pytorch, tensorflow"):
        framework_variables("jax", 0, [])


def test_a_workers_plan_carries_its_framework_and_an_older_plan_reads_pytorch() -> None:
    plan = {"argv": ["python", "train.py"], "job_id": "job-1"}
    assert CommandPlan.from_dict(plan).framework == "pytorch"
    assert CommandPlan.from_dict({**plan, "framework": "tensorflow"}).framework == "tensorflow"
