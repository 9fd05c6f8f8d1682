"""The pure parts of issue 13's fixes, each on its own: data roots, the workers' environment
allow-list, the memory floor, limits per user, hyperparameter depth, downsampling and
retention in the store, relative checkpoint paths, and streams that end."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from jobs.isolation import only_environment, worker_environment
from jobs.memory import GIB, IMAGE_MODELS, estimate
from jobs.spec import MAX_HYPERPARAMETER_DEPTH, JobSpec, nesting_depth
from jobs.workloads.data_paths import DataAccess, PathRefused
from service.problems import Problem
from service.quotas import Usage, UserLimits, check, check_priority, scheduler_quotas
from service.schemas import downsample
from service.settings import Settings
from service.store import Store, job_relative, metric_stride, with_relative_paths
from service.streams import REVOKED, Hub, job_events
from tests.conftest import database_url, small_job

# -- data roots ---------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "alice": tmp_path / "data" / "alice",
        "bob": tmp_path / "data" / "bob",
        "shared": tmp_path / "shared",
        "service": tmp_path / "shared" / "service",
    }
    for p in paths.values():
        p.mkdir(parents=True)
    (paths["alice"] / "labels.csv").write_text("text,label\nsecret,1\n")
    (paths["service"] / "etrain.db").write_text("")
    return paths


def access(layout: dict[str, Path]) -> DataAccess:
    root = layout["alice"].parent
    return DataAccess([f"{root}/{{user}}", str(layout["shared"])], [str(layout["service"])])


def test_a_user_reads_under_their_own_root_and_the_shared_one(layout: dict[str, Path]) -> None:
    a = access(layout)
    own = str(layout["bob"] / "x.csv")
    assert a.authorize("hyperparameters.data_path", own, "bob") == own
    assert a.authorize("f", str(layout["shared"] / "common"), "bob").endswith("/shared/common")


@pytest.mark.parametrize(
    "make_path,why",
    [
        (lambda d: d["alice"] / "labels.csv", "not under a data root you may read"),
        (lambda d: d["bob"] / ".." / "alice" / "labels.csv", "not under a data root"),
        (lambda d: d["bob"] / "link.csv", "not under a data root"),  # a symlink to alice's
        (lambda d: d["service"] / "etrain.db", "overlaps the service's own files"),
        (lambda d: d["shared"], "overlaps the service's own files"),  # contains the service's
        (lambda d: Path("/etc/passwd"), "not under a data root"),
        (lambda d: Path("relative/x.csv"), "must be an absolute path"),
    ],
    ids=[
        "other-user",
        "dotdot",
        "symlink",
        "service-file",
        "contains-service",
        "system",
        "relative",
    ],
)
def test_paths_outside_a_users_roots_are_refused(
    layout: dict[str, Path], make_path: Any, why: str
) -> None:
    (layout["bob"] / "link.csv").symlink_to(layout["alice"] / "labels.csv")
    with pytest.raises(PathRefused, match=why) as err:
        access(layout).authorize("hyperparameters.data_path", str(make_path(layout)), "bob")
    assert err.value.field == "hyperparameters.data_path"


def test_without_roots_no_path_is_readable(layout: dict[str, Path]) -> None:
    with pytest.raises(PathRefused, match="no data roots configured"):
        DataAccess([], []).authorize("f", str(layout["bob"]), "bob")


def test_the_service_never_lets_jobs_read_its_own_directories(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path / "svc", checkpoint_dir=str(tmp_path / "ckpt"))
    assert {str((tmp_path / "svc").resolve()), str(tmp_path / "ckpt")} <= set(s.private_dirs)


def test_a_spec_carries_its_authorized_canonical_paths(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "workload": "text-classification",
            "hyperparameters": {"data_path": "/d/x.csv", "vocab_path": "/d/v.txt", "epochs": 1},
        }
    )
    assert spec.data_paths() == [
        ("hyperparameters.data_path", "/d/x.csv"),
        ("hyperparameters.vocab_path", "/d/v.txt"),
    ]
    moved = spec.with_data_paths({"hyperparameters.data_path": "/real/x.csv"})
    assert moved.hyperparameters["data_path"] == "/real/x.csv"
    with pytest.raises(ValidationError, match=r"use a \.txt or \.vocab file"):
        JobSpec.model_validate(
            {
                "name": "t",
                "workload": "text-classification",
                "hyperparameters": {
                    "data_path": "/d/x.csv",
                    "vocab_path": "/svc/etrain.db",
                    "epochs": 1,
                },
            }
        )


# -- the workers' environment ---------------------------------------------------------------


def test_workers_get_the_allow_list_and_never_the_services_variables() -> None:
    environ = {
        "PATH": "/bin",
        "HOME": "/root",
        "LC_ALL": "C",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "CUDA_VISIBLE_DEVICES": "0",
        "ETRAIN_API_TOKEN": "secret",
        "ETRAIN_DATABASE_URL": "postgresql://u:pw@db/etrain",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "RAY_AUTH_TOKEN": "secret",
        "MY_TEAM_SETTING": "1",
        "HF_HOME": "/cache",
    }
    env = worker_environment(environ, ["MY_TEAM_*", "ETRAIN_API_TOKEN"])
    assert sorted(env) == [
        "CUDA_VISIBLE_DEVICES",
        "HOME",
        "LC_ALL",
        "MY_TEAM_SETTING",
        "PATH",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    ]
    # Ray's own token stays only where Ray's own processes need it.
    with_auth = worker_environment({**environ, "RAY_AUTH_MODE": "token"})
    assert "RAY_AUTH_TOKEN" in with_auth


def test_only_environment_is_undone_afterwards() -> None:
    os.environ["ETRAIN_UNIT_PROBE"] = "x"
    try:
        with only_environment({"PATH": os.environ["PATH"]}):
            assert "ETRAIN_UNIT_PROBE" not in os.environ
            os.environ["SET_INSIDE"] = "1"
        assert os.environ["ETRAIN_UNIT_PROBE"] == "x" and os.environ.pop("SET_INSIDE") == "1"
    finally:
        os.environ.pop("ETRAIN_UNIT_PROBE", None)


# -- the memory floor -----------------------------------------------------------------------


def _activations(model: torch.nn.Module, size: int) -> float:
    total = 0

    def count(_m: Any, _i: Any, out: Any) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel()

    leaves = [m for m in model.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    with torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    for h in hooks:
        h.remove()
    return total / (size * size)


@pytest.mark.parametrize("name", sorted(IMAGE_MODELS))
def test_the_image_models_constants_are_what_the_models_have(name: str) -> None:
    from jobs.workloads.image_classification import build_model
    from jobs.workloads.image_classification_params import ImageClassificationHyperparameters

    model = build_model(ImageClassificationHyperparameters(model=name, num_classes=7, max_steps=1))
    backbone, head_in, per_pixel = IMAGE_MODELS[name]
    assert sum(p.numel() for p in model.parameters()) == backbone + head_in * 7 + 7
    assert _activations(model.train(), 224) == pytest.approx(per_pixel, rel=0.01)


def test_the_text_models_parameters_are_counted_exactly() -> None:
    from jobs.workloads.text_classification import TextEncoderClassifier

    hp = {"data_path": "/d/x.csv", "epochs": 1, "vocab_size": 500, "width": 32, "layers": 3}
    spec = JobSpec.model_validate(
        {"name": "t", "workload": "text-classification", "hyperparameters": hp}
    )
    floor = estimate(spec)
    assert floor is not None
    model = TextEncoderClassifier(500, 2, 128, 32, 4, 3, 128, 0.1)
    head = 32 * 2 + 2  # the classes are known only from the data: left out of the floor
    assert floor.parts["parameters"] == (sum(p.numel() for p in model.parameters()) - head) * 4


def _spec(workload: str, hp: dict[str, Any], max_workers: int = 1) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "workload": workload,
            "hyperparameters": hp,
            "scaling": {"min_workers": 1, "max_workers": max_workers},
        }
    )


def test_the_floor_tells_absurd_specs_from_ordinary_ones() -> None:
    readme = estimate(JobSpec.model_validate(small_job()))
    assert readme is not None and readme.total < 0.1 * GIB
    huge_image = _spec(
        "image-classification",
        {
            "model": "resnet50",
            "image_size": 1024,
            "num_classes": 100_000,
            "global_batch_size": 1_048_576,
            "max_steps": 1,
        },
    )
    wide_text = _spec(
        "text-classification",
        {"data_path": "/d/x.csv", "layers": 48, "width": 8192, "heads": 64, "epochs": 1},
    )
    image_floor, text_floor = estimate(huge_image), estimate(wide_text)
    assert image_floor is not None and image_floor.total > 1000 * GIB
    assert text_floor is not None and text_floor.total > 500 * GIB
    assert "parameters" in text_floor.describe()
    custom = _spec("tests.workloads.chatty:train_loop", {})
    assert estimate(custom) is None


def test_fsdp_shards_the_training_state_over_the_workers() -> None:
    hp = {"model": "resnet18", "max_steps": 1, "global_batch_size": 64}
    ddp, fsdp = _spec("image-classification", hp, 4), _spec("image-classification", hp, 4)
    fsdp = fsdp.model_copy(
        update={"distributed": fsdp.distributed.model_copy(update={"strategy": "fsdp"})}
    )
    a, b = estimate(ddp), estimate(fsdp)
    assert a is not None and b is not None
    assert b.parts["parameters"] == a.parts["parameters"] / 4


# -- limits per user --------------------------------------------------------------------------


def _limits(**kw: Any) -> UserLimits:
    return UserLimits.of(Settings(user_max_active_jobs=2), kw)


def test_limits_refuse_with_the_limit_named() -> None:
    one_cpu_job = JobSpec.model_validate(small_job())  # 1..2 workers of 1 CPU
    check("bob", _limits(), Usage(), one_cpu_job)
    with pytest.raises(Problem) as err:
        check("bob", _limits(), Usage(jobs=2), one_cpu_job)
    assert (err.value.status, err.value.extensions["limit"]) == (429, "max_active_jobs")
    with pytest.raises(Problem) as err:
        check("bob", _limits(max_cpus=3), Usage(jobs=1, workers=2, cpus=2), one_cpu_job)
    assert (err.value.status, err.value.extensions["limit"]) == (429, "max_cpus")
    with pytest.raises(Problem) as err:
        check("bob", _limits(max_cpus=1), Usage(), one_cpu_job)  # 2 CPUs at max_workers
    assert (err.value.status, err.value.extensions["errors"]) == (
        422,
        [
            {
                "field": "scaling.cpus_per_worker",
                "message": "the job holds up to 2 CPUs at max_workers, over bob's limit "
                "max_cpus of 1",
            }
        ],
    )


def _gpu_job(min_workers: int, max_workers: int) -> JobSpec:
    spec = small_job()
    spec["scaling"] = {"min_workers": min_workers, "max_workers": max_workers, "gpus_per_worker": 2}
    return JobSpec.model_validate(spec)


def test_workers_and_gpus_are_quotas_a_job_waits_for_not_refusals() -> None:
    """Over max_workers or max_gpus, held or asked at max_workers, the job is accepted (the
    scheduler queues it); only a min_workers over the quota, that could never run within it,
    is refused."""
    job = _gpu_job(1, 4)  # 1..4 workers of 2 GPUs
    limits = _limits(max_workers=2, max_gpus=2)
    check("bob", limits, Usage(), job)
    check("bob", limits, Usage(jobs=1, workers=2, cpus=2, gpus=4), job)
    with pytest.raises(Problem) as err:
        check("bob", limits, Usage(), _gpu_job(3, 4))
    assert (err.value.status, err.value.extensions["limit"], err.value.detail) == (
        422,
        "max_workers",
        "scaling.min_workers: the job needs 3 workers at min_workers, over bob's limit "
        "max_workers of 2",
    )
    with pytest.raises(Problem) as err:
        check("bob", limits, Usage(), _gpu_job(2, 4))
    assert (err.value.status, err.value.extensions["limit"], err.value.detail) == (
        422,
        "max_gpus",
        "scaling.min_workers: the job needs 4 GPUs at min_workers, over bob's limit max_gpus of 2",
    )


def test_only_an_admin_submits_above_normal() -> None:
    def spec(priority: Any) -> JobSpec:
        return JobSpec.model_validate({**small_job(), "priority": priority})

    for allowed in ("low", "normal", 50, 0):
        check_priority("bob", False, spec(allowed))
    for above in ("high", 51, 1000):
        check_priority("root", True, spec(above))
        with pytest.raises(Problem) as err:
            check_priority("bob", False, spec(above))
        assert (err.value.status, err.value.extensions["errors"]) == (
            403,
            [
                {
                    "field": "priority",
                    "message": f"{above!r} is above normal (50); only an admin may submit a "
                    "job above normal",
                }
            ],
        )


def test_the_scheduler_gets_each_users_quota_and_the_default_under_star() -> None:
    settings = Settings(user_max_workers=8, user_max_gpus=None)
    overrides = {
        "carol": {"max_cpus": 4.0},  # her quota is the default's
        "bob": {"max_workers": 2, "max_gpus": 1},
    }
    assert scheduler_quotas(settings, overrides) == {
        "*": {"workers": 8, "gpus": None},
        "bob": {"workers": 2, "gpus": 1},
        "carol": {"workers": 8, "gpus": None},
    }
    assert scheduler_quotas(Settings(), {}) == {"*": {"workers": None, "gpus": None}}


def test_limits_set_for_a_user_override_the_defaults() -> None:
    limits = UserLimits.of(Settings(user_max_cpus=8), {"max_cpus": 2, "max_gpus": None})
    assert (limits.max_cpus, limits.max_gpus, limits.max_active_jobs) == (2, None, 10)
    assert Usage.total([small_job(), small_job()]) == Usage(2, 4, 4.0, 0)


# -- hyperparameter depth ------------------------------------------------------------------------


def test_hyperparameters_nested_too_deep_are_refused() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(900):
        node["a"] = {}
        node = node["a"]
    assert nesting_depth(deep) == 901
    assert nesting_depth({"a": [1, {"b": 2}]}) == 3
    with pytest.raises(ValidationError, match=f"at most {MAX_HYPERPARAMETER_DEPTH}"):
        JobSpec.model_validate({"name": "x", "workload": "a.b:c", "hyperparameters": deep})


# -- the store: downsampling in SQL, retention, limits, tokens -----------------------------------


def _metrics(first_seq: int, steps: range) -> list[dict[str, Any]]:
    return [
        {"seq": first_seq + i, "kind": "metrics", "time": float(step), "data": {"step": step}}
        for i, step in enumerate(steps)
    ]


def _run(store: Store, steps: int, finished: bool) -> str:
    job = store.create_job("m", "bob", "image-classification", small_job())
    now = time.time()
    events = [
        {"seq": 2, "kind": "state", "time": now, "data": {"state": "starting"}},
        {"seq": 3, "kind": "state", "time": now, "data": {"state": "running"}},
        *_metrics(4, range(1, steps + 1)),
        {
            "seq": steps + 4,
            "kind": "log",
            "time": now,
            "data": {"rank": 0, "attempt": 1, "lines": []},
        },
    ]
    if finished:
        events.append(
            {"seq": steps + 5, "kind": "state", "time": now, "data": {"state": "succeeded"}}
        )
    store.append_events(job.id, events)
    return job.id


def test_metrics_are_downsampled_by_the_database(store: Store) -> None:
    job_id = _run(store, 1000, finished=False)
    for every, points in [(None, None), (7, None), (None, 2), (None, 333), (None, 5000)]:
        total, columns = store.metrics(job_id, every=every, points=points)
        expected = [i + 1 for i in downsample(1000, every=every, points=points)]
        assert total == 1000 and columns["step"] == expected, (every, points)
    total, columns = store.metrics(job_id, max_points=10)  # the cap on any one request
    assert columns["step"] == [1, 101, 201, 301, 401, 501, 601, 701, 801, 901, 1000]
    assert metric_stride(10, None, None, 3) == 4
    assert store.metrics("job-none") == (0, {k: [] for k in columns})


def test_retention_deletes_old_finished_jobs_series_and_logs_only(store: Store) -> None:
    ended, running = _run(store, 5, finished=True), _run(store, 5, finished=False)
    assert store.purge_finished(datetime.now(UTC) - timedelta(days=1)) == 0
    assert store.purge_finished(datetime.now(UTC) + timedelta(seconds=1)) == 5 + 5 + 1
    assert store.metrics(ended)[0] == 0
    assert [e.kind for e in store.events(ended)] == ["state"] * 4
    assert store.metrics(running)[0] == 5 and len(store.events(running)) == 9


def test_limits_and_tokens_in_the_store(store: Store) -> None:
    store.create_user("bob", "user")
    assert store.user_limits("bob") == {}
    assert store.set_user_limits("bob", {"max_cpus": 2.0, "max_active_jobs": None}) == {
        "max_cpus": 2.0
    }
    assert store.all_user_limits() == {"bob": {"max_cpus": 2.0}}
    row, _ = store.create_token("bob", "t")
    assert store.token_active(row.id)
    store.revoke_token(row.id)
    assert not store.token_active(row.id) and not store.token_active("tok-none")


def test_checkpoint_paths_are_kept_relative_to_the_job() -> None:
    job = "job-0123"
    assert job_relative(f"/srv/etrain/checkpoints/{job}/step_0000000010", job) == (
        "step_0000000010"
    )
    assert job_relative("/elsewhere/step_0000000010/", job) == "step_0000000010"
    events = [
        {"seq": 5, "kind": "checkpoint_saved", "time": 0.0, "data": {"path": f"/x/{job}/step_1"}},
        {"seq": 6, "kind": "metrics", "time": 0.0, "data": {"path": "/keep/me"}},
    ]
    out = with_relative_paths(job, events)
    assert [e["data"]["path"] for e in out] == ["step_1", "/keep/me"]
    assert events[0]["data"]["path"] == f"/x/{job}/step_1"  # the input is not changed


# -- streams ---------------------------------------------------------------------------------------


class _EndedJobStore:
    """A store holding one ended job with three events."""

    state = "cancelled"

    def events(self, job_id: str, after: int, limit: int) -> list[Any]:
        return []

    def get_job(self, job_id: str) -> Any:
        return self


def test_a_stream_of_an_ended_job_past_its_last_event_ends_at_once() -> None:
    async def scenario() -> list[str]:
        out = []
        stream = job_events(_EndedJobStore(), Hub(10), "j", 3, keepalive_s=30)
        async for text in stream:
            out.append(text)
        return out

    began = time.monotonic()
    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == []
    assert time.monotonic() - began < 1


def test_streams_per_token_are_capped_and_revocation_ends_them() -> None:
    async def scenario() -> None:
        hub = Hub(10, streams_per_token=2)
        assert hub.claim_stream("t") and hub.claim_stream("t") and not hub.claim_stream("t")
        assert hub.claim_stream("other")
        hub.release_stream("t")
        assert hub.claim_stream("t")
        sub = hub.subscribe(None, "t")
        waiting = asyncio.ensure_future(sub.next(30))
        await asyncio.sleep(0.01)
        assert hub.revoke("t") == 1
        assert await asyncio.wait_for(waiting, 1) is None and sub.revoked

    asyncio.run(scenario())
    assert "event: revoked" in REVOKED


def test_the_migration_makes_stored_checkpoint_paths_relative(
    store_backend: str, tmp_path: Path
) -> None:
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine, text

    from service.store import MIGRATIONS

    with database_url(store_backend, tmp_path) as url:
        engine = create_engine(url)
        config = Config()
        config.set_main_option("script_location", MIGRATIONS)
        with engine.begin() as conn:  # a database as the previous version left it
            config.attributes["connection"] = conn
            command.upgrade(config, "0002")
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, owner, workload, spec, state, world_size, "
                    "step, restarts, last_seq, created_at, updated_at) VALUES ('job-old', "
                    "'old', 'admin', 'image-classification', '{}', 'running', 1, 10, 0, 2, "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO checkpoints (job_id, step, path, size_bytes, created_at, "
                    "removed) VALUES ('job-old', 10, '/srv/etrain/checkpoints/job-old/"
                    "step_0000000010', 100, 0, false)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO job_events (job_id, seq, kind, time, data) VALUES ('job-old', "
                    "2, 'checkpoint_saved', 0, :data)"
                ),
                {"data": '{"step": 10, "path": "/srv/etrain/checkpoints/job-old/step_0000000010"}'},
            )
        engine.dispose()
        store = Store(url)
        try:
            assert [c.path for c in store.checkpoints("job-old")] == ["step_0000000010"]
            (saved,) = store.events("job-old", 1)
            assert saved.data == {"step": 10, "path": "step_0000000010"}
        finally:
            store.close()


def test_a_users_code_reads_whole_only_the_roots_that_hold_none_of_the_services_files(
    tmp_path: Path,
) -> None:
    from jobs.workloads.data_paths import DataAccess

    (tmp_path / "shared").mkdir()
    (tmp_path / "users" / "alice").mkdir(parents=True)
    (tmp_path / "all" / "service").mkdir(parents=True)
    access = DataAccess(
        [str(tmp_path / "shared"), str(tmp_path / "users" / "{user}"), str(tmp_path / "all")],
        [str(tmp_path / "all" / "service")],
    )
    assert access.readable_trees("alice") == [
        str(tmp_path / "shared"),
        str(tmp_path / "users" / "alice"),
    ]
