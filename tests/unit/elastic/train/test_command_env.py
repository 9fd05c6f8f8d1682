"""What a command job's process is given: torchrun's variables, and nothing of the worker's."""

from __future__ import annotations

import sys

from elastic.train.command_env import (
    FIRST_UID,
    UIDS,
    Place,
    child_environment,
    places,
    resolve_argv,
    torchrun_variables,
    uid_of,
)


def test_ranks_on_one_node_are_numbered_in_rank_order_and_nodes_by_their_first_rank() -> None:
    assert places(["b", "a", "b", "c", "a"]) == [
        Place(0, 2, 0, 3),
        Place(0, 2, 1, 3),
        Place(1, 2, 0, 3),
        Place(0, 1, 2, 3),
        Place(1, 2, 1, 3),
    ]
    assert places(["only"]) == [Place(0, 1, 0, 1)]


def test_a_worker_gets_the_variables_torchrun_gives_one() -> None:
    variables = torchrun_variables(
        3, 4, Place(1, 2, 1, 2), "10.0.0.5", 29500, restart_count=2, max_restarts=3, run_id="j"
    )
    assert variables == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "j",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def test_the_child_keeps_nothing_of_ray_or_the_service() -> None:
    worker = {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "CUDA_VISIBLE_DEVICES": "0",
        "RAY_ADDRESS": "10.0.0.1:6379",
        "RAY_AUTH_TOKEN": "secret",
        "ETRAIN_API_TOKEN": "secret",
        "ETRAIN_DATABASE_URL": "postgresql://u:p@db/etrain",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "MLFLOW_TRACKING_URI": "http://u:p@mlflow",
        "HOME": "/root",
        "PYTHONPATH": "/ray/site",
    }
    env = child_environment(worker, "/tmp/work", {"RANK": "0"})
    assert env == {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "CUDA_VISIBLE_DEVICES": "0",
        "HOME": "/tmp/work",
        "TMPDIR": "/tmp/work/.tmp",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "RANK": "0",
    }


def test_python_is_the_workers_interpreter_and_other_programs_stay() -> None:
    assert resolve_argv(["python", "train.py", "-x"]) == [sys.executable, "train.py", "-x"]
    assert resolve_argv(["python3", "t.py"], python="/opt/py") == ["/opt/py", "t.py"]
    assert resolve_argv(["bash", "run.sh"]) == ["bash", "run.sh"]


def test_an_owner_always_gets_the_same_unprivileged_uid() -> None:
    uids = {owner: uid_of(owner) for owner in ["alice", "bob", "admin", ""]}
    assert uids == {owner: uid_of(owner) for owner in uids}
    assert all(FIRST_UID <= uid < FIRST_UID + UIDS for uid in uids.values())
    assert len(set(uids.values())) == len(uids)
