import pytest

from elastic.train.worker_config import WorkerConfig, WorkerConfigError

SENT = {
    "train_loop": "jobs.workloads.image_classification:train_loop",
    "attempt": 3,
    "supervisor": "job-abc",
    "namespace": "etrain",
    "checkpoint_dir": "/ckpt/abc",
    "every_steps": 10,
    "keep": 2,
    "max_workers": 4,
    "resume_path": "/ckpt/abc/step_0000000020",
}


def test_what_the_supervisor_sends_today_parses_into_typed_fields() -> None:
    cfg = WorkerConfig.from_dict(SENT)
    assert cfg == WorkerConfig(
        checkpoint_dir="/ckpt/abc",
        every_steps=10,
        keep=2,
        max_workers=4,
        attempt=3,
        train_loop="jobs.workloads.image_classification:train_loop",
        supervisor="job-abc",
        namespace="etrain",
        resume_path="/ckpt/abc/step_0000000020",
    )
    with pytest.raises(AttributeError):
        cfg.keep = 5  # type: ignore[misc]


def test_keys_a_newer_supervisor_adds_are_ignored_and_new_ones_default() -> None:
    cfg = WorkerConfig.from_dict({**SENT, "something_new": 1, "resume_path": None})
    assert cfg.resume_path is None and cfg.attempt == 3
    minimal = WorkerConfig.from_dict(
        {"checkpoint_dir": "/c", "every_steps": 5, "keep": 1, "max_workers": 2}
    )
    assert (minimal.attempt, minimal.supervisor, minimal.resume_path) == (1, None, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"every_steps": 0}, "_elastic.every_steps: a positive integer, not 0"),
        ({"keep": True}, "_elastic.keep: a positive integer, not True"),
        ({"checkpoint_dir": ""}, "_elastic.checkpoint_dir: missing"),
        ({"namespace": None}, "_elastic.namespace: needed to find the supervisor"),
    ],
)
def test_a_malformed_config_is_refused_with_the_key_named(change: dict, message: str) -> None:
    with pytest.raises(WorkerConfigError) as e:
        WorkerConfig.from_dict({**SENT, **change})
    assert str(e.value) == message


def test_a_missing_required_key_is_named() -> None:
    with pytest.raises(WorkerConfigError, match="missing keep, max_workers"):
        WorkerConfig.from_dict({"checkpoint_dir": "/c", "every_steps": 5})
