"""How long does training stall for a checkpoint? A model of a few hundred MiB, trained by
the real ``elastic.train.context`` code on one worker, with checkpoints written in the background
(what jobs do), written inline (the old way: copy, write, fsync, hash, publish, prune on
the training thread), and not at all.

For each run it prints, per checkpoint: the stall (the time the training thread spent in
the checkpoint call, which with background writes is the copy to CPU memory) as a share of
the median step time, and the overhead (the run's extra wall time over the run without
checkpoints, per checkpoint; this includes the background writer taking CPU from training).
Runs of the three kinds are interleaved and repeated; medians and ranges are printed.

    .venv/bin/python -m bench.checkpoint_stall [--rounds 3] [--width 3584] [--layers 6]

``--phases`` prints instead what each part of one checkpoint of that model costs on its own
(wall and CPU seconds, median of ``--rounds``), with training stopped: the copy to CPU
memory into new memory and into buffers kept from the checkpoint before, ``torch.save``
with and without its CRC-32, the fsync, and the SHA-256 of the file for the manifest.

No Ray: one process, as one worker of a job. Checkpoints go to a temporary directory on
the local disk.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic.checkpoint.storage import sha256_of
from elastic.checkpoint.writer import CheckpointManager, StagingBuffers, cpu_copy, save_unchecked
from elastic.train.context import run_with_context
from elastic.train.worker import WorkerContext

KINDS = ("none", "background", "inline")


class Vectors(Dataset):
    def __init__(self, size: int, width: int) -> None:
        self.size, self.width = size, width

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.width, generator=g), torch.randn(self.width, generator=g)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean(dim=1)


def one_run(kind: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    steps, every = args.steps, args.every
    stalls: list[float] = []
    step_starts: list[float] = []
    original_save = CheckpointManager.save
    original_before_update = CheckpointManager.before_update

    def timed_save(self: CheckpointManager, step: int) -> None:
        start = time.perf_counter()
        original_save(self, step)
        if kind == "inline":
            self.wait()
        stalls.append(time.perf_counter() - start)

    def timed_before_update(self: CheckpointManager) -> None:
        # The optimizer step after a checkpoint waits here for the copy of what it changes:
        # part of that checkpoint's stall.
        start = time.perf_counter()
        original_before_update(self)
        if stalls:
            stalls[-1] += time.perf_counter() - start

    def loop(config: dict[str, Any], ctx: Any) -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        model = ctx.prepare_model(nn.Sequential(*layers[:-1]))
        ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9))
        for batch in ctx.batches(Vectors(10_000, args.width), args.batch, max_steps=steps):
            step_starts.append(time.perf_counter())
            ctx.train_step(batch, mse)

    # No checkpoint at all: an interval past the run (the final one is not timed).
    interval = every if kind != "none" else steps + 1
    worker = WorkerContext.standalone(0, 1, str(root / kind), every_steps=interval, keep=2)
    CheckpointManager.save = timed_save  # type: ignore[method-assign]
    CheckpointManager.before_update = timed_before_update  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        run_with_context(loop, {}, worker)
        wall = step_starts[-1] - start
    finally:
        CheckpointManager.save = original_save  # type: ignore[method-assign]
        CheckpointManager.before_update = original_before_update  # type: ignore[method-assign]
    durations = [b - a for a, b in itertools.pairwise(step_starts)]
    # The final checkpoint (at the last step) ends the run and is not a stall of training.
    timed = stalls[:-1] if kind != "none" else []
    size = sum(p.numel() * p.element_size() for p in nn.Linear(args.width, args.width).parameters())
    return {
        "wall": wall,
        "step": statistics.median(durations),
        "stalls": timed,
        "checkpoints": len(timed),
        "model_mib": args.layers * size / 2**20,
    }


def phases(args: argparse.Namespace, root: Path) -> None:
    """Each part of one checkpoint of the bench's model, alone."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    model(torch.randn(args.batch, args.width)).pow(2).mean().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    staging = StagingBuffers()
    cpu_copy(state, staging=staging)  # the buffers of "the checkpoint before"
    snapshot = cpu_copy(state)
    path = root / "state.pt"

    def fsync() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    parts: dict[str, Callable[[], object]] = {
        "copy into new memory": lambda: cpu_copy(state),
        "copy into kept buffers": lambda: cpu_copy(state, staging=staging),
        "torch.save with its CRC-32": lambda: torch.save(snapshot, path),
        "torch.save without (the writer's)": lambda: save_unchecked(snapshot, path),
        "fsync": fsync,
        "SHA-256 of the file": lambda: sha256_of(path),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, part in parts.items():
            wall, cpu = time.perf_counter(), time.process_time()
            part()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    mib = sum(t.numel() * t.element_size() for t in snapshot["model"].values()) * 2 / 2**20
    print(f"one checkpoint of {mib:.0f} MiB, median (range) of {args.rounds}\n")
    print("| part | wall s | CPU s |\n| --- | --- | --- |")
    for name, runs in times.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"| {name} | {spread(walls, '{:.3f}')} | {spread(cpus, '{:.3f}')} |")


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}-{fmt.format(max(values))})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--phases", action="store_true", help="each part of a checkpoint alone")
    args = parser.parse_args()
    if args.phases:
        with tempfile.TemporaryDirectory() as tmp:
            phases(args, Path(tmp))
        return
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        one_run("background", args, Path(tmp) / "warm-up")  # first-touch allocations, caches
        for r in range(args.rounds):
            for kind in KINDS:
                root = Path(tmp) / f"round{r}"
                results[kind].append(one_run(kind, args, root))
                res = results[kind][-1]
                print(
                    f"round {r + 1} {kind:10s} wall {res['wall']:6.1f} s  step "
                    f"{res['step']:.3f} s  stalls {[round(s, 3) for s in res['stalls']]}",
                    flush=True,
                )
    first = results["none"][0]
    print(
        f"\nmodel: {args.layers} x Linear({args.width}, {args.width}), "
        f"{first['model_mib']:.0f} MiB of parameters (+ as much SGD momentum); batch {args.batch}; "
        f"{args.steps} steps, a checkpoint every {args.every} "
        f"({results['inline'][0]['checkpoints']} timed per run); "
        f"{args.rounds} rounds interleaved\n"
    )
    print(
        "| checkpoints | step s | stall per checkpoint s | stall / step % "
        "| overhead per checkpoint / step % |"
    )
    print("| --- | --- | --- | --- | --- |")
    for kind in KINDS:
        runs = results[kind]
        steps = [r["step"] for r in runs]
        if kind == "none":
            print(f"| none | {spread(steps, '{:.3f}')} | - | - | - |")
            continue
        stall = [statistics.median(r["stalls"]) for r in runs]
        share = [100 * statistics.median(r["stalls"]) / r["step"] for r in runs]
        overhead = [
            100 * (r["wall"] - base["wall"]) / r["checkpoints"] / base["step"]
            for r, base in zip(runs, results["none"], strict=True)
        ]
        print(
            f"| {kind} | {spread(steps, '{:.3f}')} | {spread(stall, '{:.3f}')} | "
            f"{spread(share)} | {spread(overhead)} |"
        )


if __name__ == "__main__":
    main()
