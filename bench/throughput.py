"""Throughput and start-up: plain torchrun DDP, plain Ray Train, and a job through this service.

The same model on the same seeded synthetic 32x32 images, the same optimizer (SGD with
momentum), 64 samples per worker per step, the same number of steps, at 1 and 2 workers:

  (a) ``torchrun`` running a plain DDP loop (Gloo, ``DistributedSampler``);
  (b) Ray Train's ``TorchTrainer`` running the same plain loop (``prepare_model``,
      ``prepare_data_loader``), on a Ray instance started beforehand;
  (c) the job submitted to ``etrain serve`` in restart mode (its embedded Ray started
      beforehand);
  (d) the same job with ``fault_tolerance: in_place`` (torchft's quorum every step), whose
      gap to (a) is the per-step cost of in-place recovery, printed in ms.

Like with like: the Ray instance of (b) and the service of (c) are both up for the whole
run, so every side shares the machine with the same idle processes; each repetition runs
every case on every side, the sides' order rotating from one repetition to the next, and
the table gives the median and range over the repetitions.

Steady-state samples/s is the samples of steps WARM+1..last over the time they took, on the
clock of the worker of rank 0 on every side: (a) and (b) stamp the end of steps WARM and
last; (c) and (d) sum the windows their loops report every WARM steps (each measured on
the worker, from after one report to the next, so (c)'s small report all-reduce is left
out; the plain loops have none; (d)'s quorum and torchft all-reduce are in). Time to
first step is from launch to the end of step 1: (a) from starting ``torchrun``, (b) from
building the ``TorchTrainer`` (before ``fit()``), (c) and (d) from ``POST /v1/jobs``; their
step 1 is when the service received the step's report (the worker does not stamp it),
which counts the report's way to the store against us. Every worker uses one CPU thread
(Ray's default for one CPU; set for torchrun too).

    .venv/bin/python -m bench.throughput --repeat 3 [--sides ad] [--models resnet18]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

PER_WORKER_BATCH = 64
WARM = 10
STEPS = {"small_cnn": 200, "resnet18": 60}
WORLDS = (1, 2)
TOKEN = "bench-token"


# -- the plain loop that (a) and (b) run ----------------------------------------------------


def plain_loop(
    model_name: str, steps: int, out: str, launched: float, use_ray: bool = False
) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from jobs.workloads.image_classification import SyntheticImages, build_model
    from jobs.workloads.image_classification_params import ImageClassificationHyperparameters

    hp = ImageClassificationHyperparameters(
        model=model_name,
        max_steps=steps,  # type: ignore[arg-type]
        synthetic_samples=2048,
        learning_rate=0.05,
    )
    dataset = SyntheticImages(hp.synthetic_samples, hp.image_size, hp.num_classes, hp.seed)
    model = build_model(hp)
    if use_ray:
        import ray.train
        import ray.train.torch

        rank = ray.train.get_context().get_world_rank()
        world = ray.train.get_context().get_world_size()
        model = ray.train.torch.prepare_model(model)
        loader = ray.train.torch.prepare_data_loader(
            DataLoader(dataset, batch_size=PER_WORKER_BATCH, shuffle=True, drop_last=True)
        )
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(dataset, batch_size=PER_WORKER_BATCH, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=hp.learning_rate, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    step, epoch, times = 0, 0, {}
    while step < steps:
        if not use_ray:
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(inputs), targets).backward()
            optimizer.step()
            step += 1
            if step in (1, WARM, steps):
                times[step] = time.time()
            if step == steps:
                break
        epoch += 1
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "first_step_s": times[1] - launched,
                    "samples_per_s": (steps - WARM)
                    * PER_WORKER_BATCH
                    * world
                    / (times[steps] - times[WARM]),
                }
            )
        )
    if not use_ray:
        dist.destroy_process_group()


def ray_train_loop(config: dict[str, Any]) -> None:
    plain_loop(config["model"], config["steps"], config["out"], config["launched"], use_ray=True)


# -- (a) torchrun ---------------------------------------------------------------------------


def run_torchrun(model_name: str, world: int, out: str) -> dict[str, float]:
    launched = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world}",
            "--master_addr=127.0.0.1",
            "--master_port=29611",
            "-m",
            "bench.throughput",
            "--worker",
            model_name,
            str(STEPS[model_name]),
            out,
            str(launched),
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(Path(out).read_text())


# -- (b) Ray Train --------------------------------------------------------------------------


def run_ray_train(model_name: str, world: int, out: str, storage: str) -> dict[str, float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Launched when the trainer is built, before anything is handed to Ray.
    config = {"model": model_name, "steps": STEPS[model_name], "out": out, "launched": time.time()}
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"bench-{model_name}-{world}", storage_path=storage),
    )
    trainer.fit()
    return json.loads(Path(out).read_text())


# -- (c) this service -----------------------------------------------------------------------


def job_spec(model_name: str, world: int, mode: str = "restart") -> dict[str, Any]:
    steps = STEPS[model_name]
    return {
        "name": f"bench-{model_name}-{world}",
        "workload": "image-classification",
        "hyperparameters": {
            "model": model_name,
            "dataset": "synthetic",
            "max_steps": steps,
            "global_batch_size": PER_WORKER_BATCH * world,
            "learning_rate": 0.05,
            "synthetic_samples": 2048,
            "report_every_steps": WARM,
        },
        "scaling": {"min_workers": world, "max_workers": world, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": steps, "keep": 1},
        "fault_tolerance": mode,
    }


def run_service(
    client: Any, model_name: str, world: int, mode: str = "restart"
) -> dict[str, float]:
    steps = STEPS[model_name]
    submitted = time.time()
    job = client.post("/v1/jobs", json=job_spec(model_name, world, mode)).json()
    while client.get(f"/v1/jobs/{job['id']}").json()["state"] not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        time.sleep(0.5)
    events = client.get(
        f"/v1/jobs/{job['id']}/events", params={"kind": "metrics", "limit": 5000}
    ).json()["items"]
    first = min(
        datetime.fromisoformat(e["time"]).timestamp() for e in events if e["data"]["step"] == 1
    )
    # Each report after step WARM covers the WARM steps before it, timed on the worker.
    windows = [e["data"] for e in events if e["data"]["step"] > WARM]
    if sorted(d["step"] for d in windows) != list(range(2 * WARM, steps + 1, WARM)):
        raise RuntimeError(f"unexpected reports: {[d['step'] for d in windows]}")
    samples = (steps - WARM) * PER_WORKER_BATCH * world
    seconds = sum(WARM * PER_WORKER_BATCH * world / d["samples_per_s"] for d in windows)
    return {"first_step_s": first - submitted, "samples_per_s": samples / seconds}


def start_service(data_dir: str, port: int) -> subprocess.Popen[bytes]:
    import httpx

    env = {
        **os.environ,
        "ETRAIN_DATA_DIR": data_dir,
        "ETRAIN_API_TOKEN": TOKEN,
        "ETRAIN_PORT": str(port),
        "ETRAIN_LOG_LEVEL": "warning",
        "ETRAIN_RAY_NUM_CPUS": str(max(WORLDS)),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.time() > deadline or server.poll() is not None:
            server.kill()
            raise RuntimeError("the service did not start")
        time.sleep(1)


# -- the table ------------------------------------------------------------------------------


SIDES = {"a": "torchrun", "b": "Ray Train", "c": "elastic-train", "d": "elastic-train in place"}


def _cell(values: list[float], fmt: str) -> str:
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}-{high})" if len(values) > 1 else mid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=3, help="runs of every case on every side")
    parser.add_argument("--sides", default="abcd", help="which sides, e.g. ad")
    parser.add_argument("--models", default=",".join(STEPS), help="e.g. resnet18")
    args = parser.parse_args()
    if args.worker:  # a torchrun worker
        model_name, steps, out, launched = args.worker
        plain_loop(model_name, int(steps), out, float(launched))
        return

    import httpx
    import ray

    work = tempfile.mkdtemp(prefix="etrain-throughput-")
    runs: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    cases = [(m, w) for m in args.models.split(",") for w in WORLDS]
    ray.init(address="local", num_cpus=max(WORLDS), include_dashboard=False, log_to_driver=False)
    server = start_service(f"{work}/service", 8766)
    try:
        with httpx.Client(
            base_url="http://127.0.0.1:8766",
            timeout=60,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as client:
            sides = {
                "a": lambda m, w, out: run_torchrun(m, w, out),
                "b": lambda m, w, out: run_ray_train(m, w, out, f"{work}/ray"),
                "c": lambda m, w, out: run_service(client, m, w),
                "d": lambda m, w, out: run_service(client, m, w, "in_place"),
            }
            order = [k for k in sides if k in args.sides]
            for rep in range(args.repeat):
                for m, w in cases:
                    for side in order:
                        out = f"{work}/{side}-{m}-{w}-{rep}.json"
                        result = sides[side](m, w, out)
                        runs.setdefault((m, w, side), []).append(result)
                        print(rep, SIDES[side], m, w, result, flush=True)
                order = order[1:] + order[:1]  # the next repetition starts with another side
    finally:
        server.terminate()
        server.wait(timeout=60)
        ray.shutdown()

    def values(m: str, w: int, side: str, key: str) -> list[float]:
        return [r[key] for r in runs[m, w, side]]

    def ratios(m: str, w: int, top: str, bottom: str, key: str) -> list[float]:
        # Within a repetition: the sides ran back to back on the same machine state.
        pairs = zip(values(m, w, top, key), values(m, w, bottom, key), strict=True)
        return [t / b for t, b in pairs]

    print(f"\nmedian (range) of {args.repeat} repetitions, sides rotated\n")
    chosen = [k for k in "abcd" if k in args.sides]
    pairs = [(t, b) for t, b in (("c", "b"), ("c", "a"), ("d", "a")) if {t, b} <= set(chosen)]
    print(
        "| model | workers | steps | "
        + " | ".join(f"samples/s ({k}) {SIDES[k]}" for k in chosen)
        + "".join(f" | ({t})/({b})" for t, b in pairs)
        + " | "
        + " | ".join(f"first step s ({k})" for k in chosen)
        + "".join(f" | ({t})/({b})" for t, b in pairs)
        + (" | quorum ms per step (d)-(a)" if ("d", "a") in pairs else "")
        + " |"
    )
    columns = 3 + 2 * (len(chosen) + len(pairs)) + (("d", "a") in pairs)
    print("|" + " --- |" * columns)
    for m, w in cases:
        speed = [_cell(values(m, w, k, "samples_per_s"), "{:.0f}") for k in chosen]
        first = [_cell(values(m, w, k, "first_step_s"), "{:.1f}") for k in chosen]
        row = [m, str(w), str(STEPS[m]), *speed]
        row += [_cell(ratios(m, w, t, b, "samples_per_s"), "{:.2f}") for t, b in pairs]
        row += first
        row += [_cell(ratios(m, w, t, b, "first_step_s"), "{:.2f}") for t, b in pairs]
        if ("d", "a") in pairs:
            # The time a step takes more in place than plain DDP, per repetition: the
            # quorum, its all-reduce through torchft, the per-step bookkeeping.
            per_step = PER_WORKER_BATCH * w
            extra = [
                1000 * (per_step / d - per_step / a)
                for d, a in zip(
                    values(m, w, "d", "samples_per_s"),
                    values(m, w, "a", "samples_per_s"),
                    strict=True,
                )
            ]
            row.append(_cell(extra, "{:.1f}"))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
