"""Recovery after a node failure: stock Ray Train 2.60 elastic vs elastic-train.

One process, one cluster (a head that trains nothing and three one-CPU nodes, from
ray.cluster_utils.Cluster, a fresh node added back after each run): the same small job (the
small CNN on synthetic 32x32 images, global batch 60 at any world size, a checkpoint every
10 steps, STEPS steps) runs under stock Ray Train (ScalingConfig(num_workers=(1, 3)),
FailureConfig(max_failures=3)) and through this service; in each, the node of rank 1 is
killed (its raylet, not a polite shutdown) once step KILL_AT_STEP is seen. The sides
alternate (stock first in odd repetitions, ours first in even ones), --repeat times.

Per side it prints the median and range of: recovery seconds (the kill to the first step
of a worker group started after it), steps redone, and wall time (start to the last step,
the same end point on both sides). For ours, the job's own figures too: recovery_seconds
from the first failure signal and detection_seconds, as its events report them.

    .venv/bin/python -m bench.recovery --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jobs.launcher import FAST_FAILURE_DETECTION, keep_ray_on_loopback

NAMESPACE = "bench-recovery"
STEPS = 120
EVERY = 10
KILL_AT_STEP = 24
BATCH = 60  # divides over 1, 2 and 3 workers: the same global batch on both sides

# (time, rank, step, node, session, world size): a session is one worker process, or one
# attempt; the world size is known on our side only (0 for stock).
Step = tuple[float, int, int, str, str, int]


@ray.remote(num_cpus=0)
class Probe:
    """Where the stock run's workers say which step they finished, and on which node."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def record(self, rank: int, step: int, node: str, session: str) -> None:
        self.steps.append((time.time(), rank, step, node, session, 0))

    def all(self) -> list[Step]:
        return list(self.steps)


def stock_train_loop(config: dict[str, Any]) -> None:
    """The same job written the stock way: DDP, prepare_data_loader's DistributedSampler,
    checkpoints through ray.train.report, restore from ray.train.get_checkpoint()."""
    import uuid

    import ray.train.torch
    import torch
    from torch.utils.data import DataLoader

    from jobs.workloads.image_classification import SmallCNN, SyntheticImages

    probe = ray.get_actor(config["probe"], namespace=NAMESPACE)
    session = uuid.uuid4().hex
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
    model = ray.train.torch.prepare_model(model)
    data = SyntheticImages(100_000, 32, 10, 0)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(data, batch_size=max(1, BATCH // world), shuffle=True)
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        step += 1
        probe.record.remote(rank, step, node, session)
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


def run_stock(cluster: Cluster, nodes: list[Any], storage: str) -> dict[str, float]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    head = cluster.head_node.node_id
    name = f"probe-{time.time_ns()}"  # a fresh name: the last run's probe may still be dying
    probe = Probe.options(
        name=name,
        namespace=NAMESPACE,  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, False),
    ).remote()
    trainer = TorchTrainer(
        stock_train_loop,
        train_loop_config={"probe": name},
        scaling_config=ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="stock", storage_path=storage, failure_config=FailureConfig(max_failures=3)
        ),
    )
    started = time.time()
    done = threading.Event()
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # report it in the table's run, not as a thread trace
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=fit, daemon=True).start()
    killed_at = _kill_when(lambda: ray.get(probe.all.remote()), cluster, nodes)
    done.wait()
    steps = ray.get(probe.all.remote())
    ray.kill(probe)
    if errors:
        raise errors[0]
    return _summary(steps, started, killed_at)


def serve(data_dir: str) -> tuple[Any, threading.Thread, httpx.Client]:
    """The service in a thread of this process, on this process's Ray connection."""
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    settings = Settings(
        data_dir=Path(data_dir),
        api_token="bench",  # type: ignore[arg-type]
        ray_namespace=NAMESPACE,
        event_poll_interval_s=0.1,
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer bench"}, timeout=30
    )
    return server, thread, client


def job_spec(steps: int, mode: str) -> dict[str, Any]:
    """The small CNN job every side runs, through the service."""
    return {
        "name": "bench",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "max_steps": steps,
            "global_batch_size": BATCH,
            "learning_rate": 0.05,
            "seed": 0,
            "synthetic_samples": 100_000,
        },
        "scaling": {"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": EVERY, "keep": 3},
        "fault_tolerance": mode,
    }


def run_ours(
    cluster: Cluster, nodes: list[Any], data_dir: str, mode: str = "restart"
) -> dict[str, float]:
    server, thread, client = serve(data_dir)
    started = time.time()
    job = client.post("/v1/jobs", json=job_spec(STEPS, mode)).json()
    job_id = job["id"]

    def progress() -> list[Step]:
        items = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 5000}).json()["items"]
        return [
            (
                datetime.fromisoformat(e["time"]).timestamp(),
                0,
                e["data"]["step"],
                "",
                str(e["data"]["attempt"]),
                e["data"].get("world_size", 0),
            )
            for e in items
            if e["kind"] == "metrics"
        ]

    def status() -> dict[str, Any]:
        return ray.get(
            ray.get_actor(f"etrain-supervisor-{job_id}", namespace=NAMESPACE).status.remote()
        )

    killed_at = _kill_when(
        progress, cluster, nodes, rank1_node=lambda: status()["worker_nodes"].get(1)
    )
    while client.get(f"/v1/jobs/{job_id}").json()["state"] not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        time.sleep(0.2)
    final = client.get(f"/v1/jobs/{job_id}").json()
    steps = progress()
    items = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 5000}).json()["items"]
    shrink = next(e["data"] for e in items if e["kind"] == "resized")
    server.should_exit = True
    thread.join(timeout=30)
    assert final["state"] == "succeeded", final
    if mode == "in_place":
        # No new session: the survivors train on in the same attempt. Recovery ends at the
        # first step committed at the smaller world size; the pause and the steps redone are
        # the survivors' own (the gap between the last commit before the loss and the first
        # after it, and whether the step in flight was discarded).
        lost = next(e["data"] for e in items if e["kind"] == "worker_lost")
        first_small = min(s[0] for s in steps if s[0] > killed_at and s[5] == 2)
        return {
            "recovery_s": first_small - killed_at,
            "pause_s": lost["pause_seconds"],
            "steps_redone": lost["steps_redone"],
            "wall_s": max(s[0] for s in steps if s[2] == STEPS) - started,
        }
    return _summary(steps, started, killed_at) | {
        "reported_s": shrink["recovery_seconds"],
        "detection_s": shrink.get("detection_seconds") or 0.0,
    }


def _kill_when(progress: Any, cluster: Cluster, nodes: list[Any], rank1_node: Any = None) -> float:
    """Kill the node of rank 1 once step KILL_AT_STEP is seen; returns the time of the kill."""
    while True:
        seen = progress()
        if seen and max(s[2] for s in seen) >= KILL_AT_STEP:
            break
        time.sleep(0.02)
    target_id = rank1_node() if rank1_node else next(s[3] for s in seen if s[1] == 1)
    target = next(n for n in nodes if n.node_id == target_id)
    cluster.remove_node(target, allow_graceful=False)
    nodes.remove(target)
    return time.time()


def _summary(steps: list[Step], started: float, killed_at: float) -> dict[str, float]:
    """Recovery ends at the first step of a session (worker process, attempt) that began
    after the kill; the steps redone are those the lost sessions had reached beyond the
    checkpoint the new one resumed from."""
    old_sessions = {s[4] for s in steps if s[0] <= killed_at}
    reached = max(s[2] for s in steps if s[4] in old_sessions)
    resumed = min((s for s in steps if s[4] not in old_sessions), key=lambda s: s[0])
    return {
        "recovery_s": resumed[0] - killed_at,
        "steps_redone": max(0, reached - (resumed[2] - 1)),
        "wall_s": max(s[0] for s in steps if s[2] == STEPS) - started,
    }


def _fresh_node(cluster: Cluster, nodes: list[Any]) -> None:
    """Back to three worker nodes after a run killed one."""
    while len(nodes) < 3:
        nodes.append(cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()
    time.sleep(2)  # let the previous run's actors and placement groups go


ROWS = [
    ("recovery seconds (kill to first resumed step)", "recovery_s", "{:.1f}"),
    ("longest pause of the survivors (s)", "pause_s", "{:.2f}"),
    ("steps redone", "steps_redone", "{:.0f}"),
    ("wall time, start to the last step (s)", "wall_s", "{:.1f}"),
    ("ours as reported: recovery_seconds", "reported_s", "{:.1f}"),
    ("ours as reported: detection_seconds", "detection_s", "{:.1f}"),
]


def _cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    mid = fmt.format(statistics.median(values))
    return f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side (>= 3)")
    args = parser.parse_args()
    keep_ray_on_loopback()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "_system_config": FAST_FAILURE_DETECTION},
    )
    nodes: list[Any] = []
    _fresh_node(cluster, nodes)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    work = tempfile.mkdtemp(prefix="etrain-bench-")
    sides = ["stock", "ours", "in_place"]
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for rep in range(args.repeat):
        # Each side takes each place in the order in turn.
        order = sides[rep % 3 :] + sides[: rep % 3]
        for side in order:
            where = os.path.join(work, f"{side}-{rep}")
            if side == "stock":
                run = run_stock(cluster, nodes, where)
            else:
                mode = "in_place" if side == "in_place" else "restart"
                run = run_ours(cluster, nodes, where, mode)
            results[side].append(run)
            print(f"repetition {rep + 1}, {side}: {run}", flush=True)
            _fresh_node(cluster, nodes)

    print()
    print(f"median (range) of {args.repeat} runs per side, sides alternated")
    print()
    print(f"| {'':46} | stock Ray Train 2.60 | ours, restart        | ours, in_place       |")
    print(f"| {'-' * 46} | -------------------- | -------------------- | -------------------- |")
    for label, key, fmt in ROWS:
        cells = [_cell([r[key] for r in results[side] if key in r], fmt) for side in sides]
        print(f"| {label:46} | " + " | ".join(f"{c:>20}" for c in cells) + " |")
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
