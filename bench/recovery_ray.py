"""The two stock Ray Train sides of ``bench.recovery``, and the cluster moves every side
shares (the kill of rank 1's node, a node added back, a fresh node between runs).

- stock: Ray Train 2.60 elastic (``ScalingConfig(num_workers=(1, 3))``,
  ``FailureConfig(max_failures=3)``), DDP, ``prepare_data_loader``'s ``DistributedSampler``,
  checkpoints through ``ray.train.report``: the worker group restarts from the latest one.
- ray_torchft: Ray Train 2.60's ``TorchftConfig``, written as its example
  (``ray/train/v2/examples/pytorch/torchft_linear_example.py``) does: every worker is a
  replica group with its own torchft ``Manager``, DDP and optimizer wrapped by torchft,
  torchft's ``DistributedSampler`` split by replica group, the batch per replica fixed. The
  lighthouse and timeouts are tuned as ours are (``heartbeat_timeout_ms=1000``, 5 s
  collective and manager timeouts). Ray places its lighthouse next to Train's controller
  with 1 CPU, and the bench's head offers none, so this side runs its driver in an actor on
  a 1-CPU node of its own, and its workers ask for a ``trainer`` resource that only the
  three worker nodes have.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bench.recovery_job import indexed_images
from bench.recovery_records import StepRecord

NAMESPACE = "bench-recovery"
STEPS = 600
EVERY = 10
KILL_AT_STEP = 24
GROW_AT_STEP = 40  # a node comes back once the smaller world has reached this step
BATCH = 60  # divides over 1, 2 and 3 workers: the same global batch on every side
WORKER_NODES = 3
TRAINER = {"trainer": 1}  # on every worker node, so a stock side can keep off other nodes


@ray.remote(num_cpus=0)
class Probe:
    """Where the stock sides' workers say which step they finished, and on which node."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.nodes: dict[int, str] = {}

    def record(self, record: StepRecord, node: str, worker_rank: int) -> None:
        self.steps.append(record)
        self.nodes[worker_rank] = node

    def all(self) -> list[StepRecord]:
        return list(self.steps)

    def node_of(self, worker_rank: int) -> str | None:
        """The node of Ray Train's worker of this rank (with torchft, not the quorum rank)."""
        return self.nodes.get(worker_rank)


def stock_train_loop(config: dict[str, Any]) -> None:
    """The job written the stock way: DDP, prepare_data_loader's DistributedSampler,
    checkpoints through ray.train.report, restore from ray.train.get_checkpoint()."""
    import ray.train.torch
    import torch
    from torch.utils.data import DataLoader

    from jobs.workloads.image_classification import SmallCNN

    probe = ray.get_actor(config["probe"], namespace=NAMESPACE)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    torch.manual_seed(0)
    model = SmallCNN(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    # Every rank of one worker group resumed from the same checkpoint at the same size.
    attempt = f"from-{step}-at-{world}-{config['run']}"
    model = ray.train.torch.prepare_model(model)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(indexed_images(), batch_size=max(1, BATCH // world), shuffle=True)
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y, i in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        step += 1
        record = StepRecord(time.time(), rank, step, attempt, world, True, tuple(i.tolist()))
        probe.record.remote(record, node, rank)
        if step % EVERY == 0 or step == STEPS:
            with tempfile.TemporaryDirectory() as d:
                ckpt = None
                if rank == 0:
                    torch.save(
                        {
                            "model": model.module.state_dict() if world > 1 else model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "step": step,
                        },
                        Path(d) / "state.pt",
                    )
                    ckpt = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step}, checkpoint=ckpt)
        if step >= STEPS:
            return


def torchft_train_loop(config: dict[str, Any]) -> None:
    """The job written as Ray's TorchftConfig example writes its loop."""
    import os
    from datetime import timedelta

    import ray.train
    import torch
    from torch.utils.data import DataLoader
    from torchft import (
        DistributedDataParallel,
        DistributedSampler,
        Manager,
        Optimizer,
        ProcessGroupGloo,
    )
    from torchft.checkpointing.pg_transport import PGTransport

    from jobs.workloads.image_classification import SmallCNN

    probe = ray.get_actor(config["probe"], namespace=NAMESPACE)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    torch.manual_seed(0)
    model = SmallCNN(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    timeout = timedelta(seconds=5)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda s: (
            model.load_state_dict(s["model"]),
            optimizer.load_state_dict(s["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        world_size=1,
        rank=0,
        replica_id=f"bench_{rank}",
        timeout=timeout,
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    ddp = DistributedDataParallel(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    sampler = DistributedSampler(
        indexed_images(),
        replica_rank=rank,
        num_replica_groups=world,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=0,
    )
    loader = DataLoader(indexed_images(), batch_size=BATCH // world, sampler=sampler)
    batches = iter(loader)
    loss_fn = torch.nn.CrossEntropyLoss()
    while manager.current_step() < STEPS:
        try:
            x, y, i = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y, i = next(batches)
        before = manager.current_step()
        ft_optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        ft_optimizer.step()
        after = manager.current_step()
        record = StepRecord(
            time.time(),
            manager.participating_rank() or 0,
            before + 1,
            f"torchft:{os.getpid()}",
            manager.num_participants(),
            after > before,
            tuple(i.tolist()),
        )
        probe.record.remote(record, node, rank)
    manager.shutdown()


@ray.remote(num_cpus=0, resources={"ft_head": 0.01})
class TorchftDriver:
    """Runs ``fit()`` on the lighthouse's node (Ray puts the controller on the driver's)."""

    def fit(self, probe: str, storage: str) -> None:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.train.v2.torch.torchft_config import TorchftConfig

        TorchTrainer(
            torchft_train_loop,
            train_loop_config={"probe": probe},
            scaling_config=ScalingConfig(
                num_workers=WORKER_NODES, resources_per_worker={"CPU": 1, **TRAINER}
            ),
            torch_config=TorchftConfig(
                lighthouse_kwargs={"min_replicas": 1, "heartbeat_timeout_ms": 1000},
                backend="gloo",
            ),
            # Failures let the controller replace the lost replica group alone.
            run_config=RunConfig(
                name="ray-torchft",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=3),
            ),
        ).fit()


Run = tuple[list[StepRecord], float, float, float | None]


def run_stock(cluster: Cluster, nodes: list[Any], storage: str) -> Run:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    probe, name = _probe(cluster)
    trainer = TorchTrainer(
        stock_train_loop,
        train_loop_config={"probe": name, "run": name},
        scaling_config=ScalingConfig(
            num_workers=(1, WORKER_NODES), resources_per_worker={"CPU": 1, **TRAINER}
        ),
        run_config=RunConfig(
            name="stock", storage_path=storage, failure_config=FailureConfig(max_failures=3)
        ),
    )
    return _run_probed(probe, cluster, nodes, trainer.fit)


def run_ray_torchft(cluster: Cluster, nodes: list[Any], storage: str) -> Run:
    probe, name = _probe(cluster)
    head = cluster.add_node(num_cpus=1, resources={"ft_head": 1})
    cluster.wait_for_nodes()
    try:
        driver = TorchftDriver.remote()  # type: ignore[attr-defined]
        records, started, killed_at, added_at = _run_probed(
            probe, cluster, nodes, lambda: ray.get(driver.fit.remote(name, storage))
        )
        return _split_brain(records), started, killed_at, added_at
    finally:
        cluster.remove_node(head)


def _split_brain(records: list[StepRecord]) -> list[StepRecord]:
    """The replicas that trained together are one attempt; a replica that started from
    step 1 after another had finished the job trained alone (torchft found no peer to heal
    from): its records are its own attempt, named so the summary sets them apart."""
    finished = min((r.time for r in records if r.step == STEPS and r.committed), default=None)
    first: dict[str, StepRecord] = {}
    for r in sorted(records, key=lambda r: r.time):
        first.setdefault(r.attempt, r)
    alone = {
        a for a, r in first.items() if finished is not None and r.step == 1 and r.time > finished
    }
    return [
        dataclasses.replace(
            r, attempt=f"split-brain:{r.attempt}" if r.attempt in alone else "torchft"
        )
        for r in records
    ]


def _run_probed(probe: Any, cluster: Cluster, nodes: list[Any], fit: Callable[[], Any]) -> Run:
    """Run ``fit`` in a thread; kill and add back a node as the probe's records say."""
    started = time.time()
    done = _in_thread(fit)
    killed_at, added_at = kill_and_grow(
        lambda: ray.get(probe.all.remote()),
        lambda: ray.get(probe.node_of.remote(1)),
        cluster,
        nodes,
        done.is_set,
    )
    done.wait()
    return _finish(probe, done), started, killed_at, added_at


def _probe(cluster: Cluster) -> tuple[Any, str]:
    name = f"probe-{time.time_ns()}"  # a fresh name: the last run's probe may still be dying
    probe = Probe.options(  # type: ignore[attr-defined]
        name=name,
        namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            cluster.head_node.node_id,  # type: ignore[attr-defined]
            False,
        ),
    ).remote()
    return probe, name


class _Done(threading.Event):
    error: BaseException | None = None


def _in_thread(call: Callable[[], Any]) -> _Done:
    done = _Done()

    def run() -> None:
        try:
            call()
        except BaseException as e:  # shown with the run's figures, not as a thread trace
            done.error = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def _finish(probe: Any, done: _Done) -> list[StepRecord]:
    records: list[StepRecord] = ray.get(probe.all.remote())
    ray.kill(probe)
    if done.error is not None:
        raise done.error
    return records


def kill_and_grow(
    progress: Callable[[], list[StepRecord]],
    rank1_node: Callable[[], str | None],
    cluster: Cluster,
    nodes: list[Any],
    ended: Callable[[], bool],
) -> tuple[float, float | None]:
    """Kill rank 1's node (its raylet, not a polite shutdown) once step KILL_AT_STEP is seen
    at full size;
    add a node back once the smaller world has reached GROW_AT_STEP. Returns the times of
    the kill and of the node's return (None when the job ended first)."""
    while True:
        # At full size: with torchft the first replicas train before the last one joins.
        seen = progress()
        if any(r.step >= KILL_AT_STEP and r.world == WORKER_NODES for r in seen):
            target_id = rank1_node()
            if target_id is not None:
                break
        time.sleep(0.02)
    target = next(n for n in nodes if n.node_id == target_id)
    cluster.remove_node(target, allow_graceful=False)
    killed_at = time.time()
    nodes.remove(target)
    while not ended():
        seen = progress()
        if any(
            r.time > killed_at and r.world < WORKER_NODES and r.step >= GROW_AT_STEP for r in seen
        ):
            nodes.append(cluster.add_node(num_cpus=1, resources=TRAINER))
            return killed_at, time.time()
        time.sleep(0.05)
    return killed_at, None


def fresh_nodes(cluster: Cluster, nodes: list[Any]) -> None:
    """Back to three worker nodes after a run killed one (and maybe added one back)."""
    while len(nodes) < WORKER_NODES:
        nodes.append(cluster.add_node(num_cpus=1, resources=TRAINER))
    cluster.wait_for_nodes()
    time.sleep(2)  # let the previous run's actors and placement groups go
