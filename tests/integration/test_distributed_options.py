"""Each ``distributed`` option on a world of 2 CPU workers: the same ``elastic.train.context`` code
that Ray Train workers run, in two processes joined by Gloo on loopback (no Ray: starting a
Ray Train job per option would cost ~20 s each on 2 cores). Each check trains, the loss goes
down, and the option is shown to be in effect."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elastic.checkpoint.writer import load_model
from elastic.train.context import TrainContext, run_with_context
from elastic.train.distributed import is_sharded, unwrap
from elastic.train.worker import WorkerContext
from jobs.spec import DistributedSpec
from jobs.workloads.image_classification import build_dataset, build_model
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from tests.conftest import free_port

STEPS = 24
HP = {
    "model": "small_cnn",
    "dataset": "synthetic",
    "image_size": 8,
    "synthetic_samples": 512,
    "max_steps": STEPS,
    "global_batch_size": 32,
    "learning_rate": 0.1,
    "seed": 3,
    "num_classes": 2,
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "ddp": {"bucket_cap_mb": 1},
    "fp16": {"gradient_compression": "fp16"},
    "bf16": {"gradient_compression": "bf16"},
    "powersgd": {"gradient_compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 3},
    "bf16_autocast": {"precision": "bf16"},
    "fsdp": {"strategy": "fsdp"},
    "local_sgd": {"sync": "local_sgd", "local_sgd_period": 4},
}
EVERY_STEPS = 12


def flat(model: nn.Module) -> torch.Tensor:
    """This rank's parameters (its shards, for FSDP) as one vector."""
    return torch.cat(
        [getattr(p, "_local_tensor", p).detach().flatten() for p in model.parameters()]
    )


def fact_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    """A user's train_loop(config, ctx), which also notes what it can see of the options."""
    facts: dict[str, Any] = config["_facts"]
    hp = ImageClassificationHyperparameters.model_validate(config["hyperparameters"])
    model = ctx.prepare_model(build_model(hp))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=hp.learning_rate, momentum=0.9))
    head_dtypes: set[str] = set()
    unwrap(model).head.register_forward_hook(  # type: ignore[union-attr]
        lambda m, i, out: head_dtypes.add(str(out.dtype))
    )
    params: list[list[float]] = []
    for batch in ctx.batches(
        build_dataset(hp), hp.global_batch_size, max_steps=hp.max_steps, seed=hp.seed
    ):
        ctx.train_step(batch, nn.CrossEntropyLoss(reduction="none"))
        params.append(flat(model).tolist())
    facts["params"] = params
    head = unwrap(model).head.weight  # type: ignore[union-attr]
    facts["head"] = getattr(head, "_local_tensor", head).detach().flatten().tolist()
    facts["head_dtypes"] = sorted(head_dtypes)
    facts["wrapper"] = type(model).__name__
    facts["sharded"] = is_sharded(model)
    facts["local_numel"] = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    facts["full_numel"] = sum(p.numel() for p in build_model(hp).parameters())
    comm_hooks = getattr(model, "_comm_hooks", [])
    facts["hooks"] = [h.__name__ for h, _ in comm_hooks]
    if comm_hooks and comm_hooks[0][1] is not None:
        state = comm_hooks[0][1]
        facts["powersgd"] = {
            "rank": state.matrix_approximation_rank,
            "iter": state.iter,
            "compressed_buckets": len(state.p_memory_dict),
        }
    facts["bucket_bytes_cap"] = getattr(model, "bucket_bytes_cap", None)
    facts["averaged_at"] = ctx.local_sgd.averaged_at if ctx.local_sgd else None


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, options in SCENARIOS.items():
            worker = WorkerContext.standalone(
                rank, world, f"{root}/{name}/checkpoints", every_steps=EVERY_STEPS
            )
            facts: dict[str, Any] = {}
            config = {
                "hyperparameters": HP,
                "distributed": DistributedSpec(**options).model_dump(),
                "_facts": facts,
            }
            run_with_context(fact_loop, config, worker)
            facts["losses"] = [d["loss"] for k, d in worker.local_events if k == "metrics"]
            Path(f"{root}/{name}/rank{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("options")
    for name in SCENARIOS:
        (root / name).mkdir()
    mp.spawn(_worker, args=(2, free_port(), str(root)), nprocs=2, join=True)
    out = {
        name: [json.loads((root / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        for name in SCENARIOS
    }
    for name in SCENARIOS:
        out[name][0]["checkpoints"] = sorted(
            p.name for p in (root / name / "checkpoints").glob("step_*")
        )
        out[name][0]["root"] = str(root / name / "checkpoints")
    return out


def learned(losses: list[float]) -> bool:
    return sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_option_trains_and_the_loss_goes_down(runs: dict, name: str) -> None:
    rank0, rank1 = runs[name]
    assert len(rank0["losses"]) == STEPS and rank1["losses"] == []  # rank 0 reports
    assert learned(rank0["losses"]), rank0["losses"]
    assert rank0["checkpoints"] == ["step_0000000012", "step_0000000024"]


def test_compression_hooks_are_registered_with_their_settings(runs: dict) -> None:
    assert [r["hooks"] for r in runs["ddp"]] == [[], []]
    assert [r["hooks"] for r in runs["fp16"]] == [["fp16_compress_hook"]] * 2
    assert [r["hooks"] for r in runs["bf16"]] == [["bf16_compress_hook"]] * 2
    assert [r["hooks"] for r in runs["powersgd"]] == [["powerSGD_hook"]] * 2
    for r in runs["powersgd"]:
        # One call per optimizer step; compression (its P matrices) from step 3 on.
        assert r["powersgd"]["rank"] == 2 and r["powersgd"]["iter"] == STEPS
        assert r["powersgd"]["compressed_buckets"] >= 1
    assert runs["ddp"][0]["bucket_bytes_cap"] == 1024 * 1024
    assert runs["fp16"][0]["bucket_bytes_cap"] == 25 * 1024 * 1024
    for name in ("ddp", "fp16", "bf16", "powersgd", "bf16_autocast"):
        rank0, rank1 = runs[name]
        assert rank0["wrapper"] == "DistributedDataParallel"
        assert rank0["params"][-1] == rank1["params"][-1]  # DDP keeps the replicas equal


def test_bf16_autocast_runs_the_forward_in_bfloat16(runs: dict) -> None:
    assert runs["bf16_autocast"][0]["head_dtypes"] == ["torch.bfloat16"]
    assert runs["ddp"][0]["head_dtypes"] == ["torch.float32"]


def test_fsdp_shards_the_parameters_and_checkpoints_the_whole_model(runs: dict) -> None:
    rank0, rank1 = runs["fsdp"]
    assert rank0["sharded"] and rank0["wrapper"].startswith("FSDP")
    full = rank0["full_numel"]
    # Each parameter is split along its first dimension: half of it on each rank.
    assert rank0["local_numel"] + rank1["local_numel"] == full
    assert abs(rank0["local_numel"] - rank1["local_numel"]) < full // 10
    assert rank0["params"][-1] != rank1["params"][-1]  # different shards
    # Each rank wrote its own shards (nobody gathered the model); they load into one
    # plain model.
    checkpoint = Path(rank0["root"]) / "step_0000000024"
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    assert "model" not in state and "optimizer" not in state
    pieces = sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp"))
    assert pieces == ["__0_0.distcp", "__1_0.distcp"]
    model = build_model(ImageClassificationHyperparameters.model_validate(HP))
    torch.nn.init.zeros_(model.head.weight)
    load_model(checkpoint, model)
    assert flat(model).numel() == full
    assert rank0["params"][-1] + rank1["params"][-1] != []
    assert torch.equal(model.head.weight.flatten(), torch.tensor(rank0["head"] + rank1["head"]))


def test_local_sgd_averages_exactly_every_h_steps(runs: dict) -> None:
    rank0, rank1 = runs["local_sgd"]
    assert rank0["wrapper"] == "SmallCNN"  # no DDP: no gradient all-reduce
    assert rank0["averaged_at"] == [4, 8, 12, 16, 20, 24]
    for step in range(1, STEPS + 1):
        same = rank0["params"][step - 1] == rank1["params"][step - 1]
        assert same == (step % 4 == 0), step


@pytest.mark.parametrize("name", ["ddp", "fsdp", "local_sgd", "powersgd"])
def test_a_checkpoint_from_2_workers_resumes_on_1(runs: dict, name: str, tmp_path: Path) -> None:
    """The world shrinks to one: the checkpoint of step 12 restores without a process
    group, training carries on to step 24, and ends where the uninterrupted 2-worker run
    ended: the same model for DDP and FSDP (to float32 rounding); for local SGD and
    PowerSGD, whose per-worker state a resize changes by nature, the same losses."""
    root = runs[name][0]["root"]
    worker = WorkerContext.standalone(
        0,
        1,
        str(tmp_path),
        every_steps=EVERY_STEPS,
        max_workers=2,
        resume_path=f"{root}/step_0000000012",
    )
    facts: dict[str, Any] = {}
    config = {
        "hyperparameters": HP,
        "distributed": DistributedSpec(**SCENARIOS[name]).model_dump(),
        "_facts": facts,
    }
    run_with_context(fact_loop, config, worker)
    steps = [d["step"] for k, d in worker.local_events if k == "metrics"]
    assert steps == list(range(13, STEPS + 1))
    losses = [d["loss"] for k, d in worker.local_events if k == "metrics"]
    uninterrupted = runs[name][0]["losses"][12:]
    hp = ImageClassificationHyperparameters.model_validate(HP)
    resumed = load_model(tmp_path / "step_0000000024", build_model(hp))
    reference = load_model(Path(root) / "step_0000000024", build_model(hp))
    gaps = {
        k: float((v - reference.state_dict()[k]).norm() / reference.state_dict()[k].norm())
        for k, v in resumed.state_dict().items()
    }
    loss_gap = max(abs(a - b) / b for a, b in zip(losses, uninterrupted, strict=True))
    if name in ("ddp", "fsdp"):
        assert max(gaps.values()) <= 1e-5, gaps
        assert loss_gap <= 1e-5, (losses, uninterrupted)
    else:
        mean_gap = abs(sum(losses) - sum(uninterrupted)) / sum(uninterrupted)
        assert mean_gap <= 0.05, (mean_gap, losses, uninterrupted)


# -- unequal shares and empty shares --------------------------------------------------------

UNEVEN_HP = {
    **HP,
    "synthetic_samples": 10,  # steps of 9 samples, then 1: a last batch smaller than the world
    "global_batch_size": 9,
    "max_steps": 6,
    "dtype": "float64",
}


def uneven_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hp = ImageClassificationHyperparameters.model_validate(config["hyperparameters"])
    model = ctx.prepare_model(build_model(hp), dtype=torch.float64)
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=hp.learning_rate, momentum=0.9))
    for batch in ctx.batches(
        build_dataset(hp), hp.global_batch_size, max_steps=hp.max_steps, seed=hp.seed
    ):
        ctx.train_step(batch, nn.CrossEntropyLoss(reduction="none"))
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = unwrap(model).state_dict()
    config["_facts"]["state"] = {k: v.detach().cpu() for k, v in state.items()}


def _uneven_worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank that runs fewer passes than another hangs the group: fail, don't wait 30 min.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    try:
        for strategy in ("ddp", "fsdp"):
            worker = WorkerContext.standalone(
                rank, world, f"{root}/{strategy}", every_steps=100, max_workers=8
            )
            facts: dict[str, Any] = {}
            config = {
                "hyperparameters": UNEVEN_HP,
                "distributed": DistributedSpec(strategy=strategy).model_dump(),
                "_facts": facts,
            }
            run_with_context(uneven_loop, config, worker)
            if rank == 0:
                torch.save(facts["state"], f"{root}/{strategy}.pt")
    finally:
        dist.destroy_process_group()


def test_unequal_and_empty_shares_train_like_one_worker(tmp_path: Path) -> None:
    """G=9 with max_workers 8 (micro-batches of 2) on 2 workers: shares of 5 and 4 need 3
    and 2 passes; every other step has 1 sample, so rank 1's share is empty. Both ranks run
    the same passes (padding at weight zero), and the model is the one a single worker
    trains, to float64 rounding."""
    mp.spawn(_uneven_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    alone = WorkerContext.standalone(0, 1, str(tmp_path / "one"), every_steps=100, max_workers=8)
    facts: dict[str, Any] = {}
    run_with_context(
        uneven_loop,
        {
            "hyperparameters": UNEVEN_HP,
            "distributed": DistributedSpec().model_dump(),
            "_facts": facts,
        },
        alone,
    )
    reference = facts["state"]
    for strategy in ("ddp", "fsdp"):
        state = torch.load(tmp_path / f"{strategy}.pt", weights_only=True)
        assert state.keys() == reference.keys()
        for name, ref in reference.items():
            rel = float((state[name] - ref).norm() / ref.norm())
            assert rel <= 1e-10, (strategy, name, rel)


# -- a report on one rank, and a collective that fails -------------------------------------


def reporting_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hp = ImageClassificationHyperparameters.model_validate(config["hyperparameters"])
    model = ctx.prepare_model(build_model(hp))
    ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for batch in ctx.batches(
        build_dataset(hp), 16, max_steps=10, seed=hp.seed, report_every_steps=5
    ):
        ctx.train_step(batch, nn.CrossEntropyLoss(reduction="none"))
        if batch.step == 3 and ctx.rank == 1:
            ctx.report(only_rank_1=1.0)  # not sent (rank 0's values are), must not desync
        if batch.step == 7 and ctx.rank == 0:
            ctx.report(only_rank_0=7.0)
        if batch.step == config["_die_at"] and ctx.rank == 1:
            os._exit(0)  # the process vanishes, as on a lost node


def _report_worker(rank: int, world: int, port: int, root: str, die_at: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
    )
    worker = WorkerContext.standalone(rank, world, f"{root}/ckpt", every_steps=100)
    config = {"hyperparameters": HP, "_die_at": die_at}
    try:
        run_with_context(reporting_loop, config, worker)
        outcome = "finished"
    except Exception as e:
        outcome = type(e).__name__
    Path(f"{root}/rank{rank}.json").write_text(
        json.dumps({"outcome": outcome, "events": worker.local_events})
    )
    if outcome == "finished":
        # Gloo's threads are stopped here, not by the interpreter's exit, which can find
        # one still joinable and abort the process (seen once in a full run).
        dist.destroy_process_group()


def test_a_report_on_one_rank_does_not_desync_the_collectives(tmp_path: Path) -> None:
    mp.spawn(_report_worker, args=(2, free_port(), str(tmp_path), -1), nprocs=2, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["outcome"] == "finished"
    reports = [d for k, d in rank0["events"] if k == "metrics"]
    assert [(d["step"], d["completed_step"]) for d in reports] == [(1, 1), (5, 5), (10, 10)]
    assert [d.get("only_rank_0") for d in reports] == [None, None, 7.0]
    assert not any("only_rank_1" in d for d in reports)
    saved = [d for k, d in rank0["events"] if k == "checkpoint_saved"]
    assert [(d["step"], d["completed_step"]) for d in saved] == [(10, 10)]


def test_a_failed_collective_is_recorded_before_the_error_leaves(tmp_path: Path) -> None:
    """Rank 1 vanishes at the end of step 6: rank 0's next collective fails, and it records
    a failure_signal with the last step whose optimizer step finished, then re-raises."""
    before = time.time()
    mp.spawn(_report_worker, args=(2, free_port(), str(tmp_path), 6), nprocs=2, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["outcome"] != "finished"
    (signal,) = [d for k, d in rank0["events"] if k == "failure_signal"]
    assert (signal["rank"], signal["completed_step"]) == (0, 6)
    assert before < signal["time"] < time.time()
    assert not (tmp_path / "rank1.json").exists()
