"""A ``train_loop(config, ctx)`` from a job's code package, run in the confined child a
worker starts for it (``python -m elastic.train.loop_child PLAN``), never in the worker.

The child is started as a command job's is (``elastic/train/command.py``): torchrun's
environment names its rank, world and rendezvous, its working directory holds the package,
and it reaches Ray only through its worker (``elastic/train/loop_link.py``). It forms the
attempt's process group, runs the loop with the same :class:`TrainContext` as a built-in
workload's, and exits 0 when the loop ended or paused for a resize.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

# The exit status of a child whose entrypoint cannot load.
CODE_ERROR_EXIT = 3


def load(entrypoint: str, package: Path) -> Any:
    """The function an entrypoint names in the package: ``train.py:train_loop`` (a file of
    the package) or ``trainer.loop:train_loop`` (a module of it)."""
    from elastic.train.current import arity_problem
    from elastic.train.entrypoint import EntrypointError

    where, _, name = entrypoint.rpartition(":")
    sys.path.insert(0, str(package))
    try:
        if where.endswith(".py"):
            path = (package / where).resolve()
            if not path.is_relative_to(package.resolve()) or not path.is_file():
                raise EntrypointError(f"cannot load {entrypoint}: the package has no {where}")
            module_name = path.stem
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            # Registered before it runs, as an import would: pickling its classes (a
            # DataLoader's workers, a checkpoint) finds them by module name.
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        train_loop = getattr(module, name)
    except EntrypointError:
        raise
    except (ImportError, AttributeError, SyntaxError) as e:
        raise EntrypointError(f"cannot load {entrypoint}: {type(e).__name__}: {e}") from e
    problem = arity_problem(train_loop)
    if problem is not None:
        raise EntrypointError(f"cannot run {entrypoint}: {problem}")
    return train_loop


def _device() -> Any:
    import torch

    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES"):
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def main(argv: list[str]) -> int:
    from elastic.train.entrypoint import EntrypointError
    from elastic.train.loop_link import ParentLink, PipedWorker

    plan = json.loads(Path(argv[1]).read_text())
    config: dict[str, Any] = plan["config"]
    link = ParentLink.from_environment()
    try:
        train_loop = load(plan["entrypoint"], Path.cwd())
    except EntrypointError as e:
        link.send({"code_error": str(e)})
        print(e, file=sys.stderr, flush=True)
        return CODE_ERROR_EXIT

    import torch.distributed as dist

    from elastic.addresses import bind_gloo_to
    from elastic.train.context import run_with_context
    from elastic.train.process_group import bound_store, join_process_group
    from elastic.train.worker_config import WorkerConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout_s = float(plan["timeout_s"])
    bind_gloo_to(plan["node_address"])
    device = _device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = bound_store(host, world, timeout_s, port=port) if rank == 0 else None
    join_process_group(backend, rank, world, host, port, timeout_s, master_store=store)
    meta = dict(config["_elastic"])
    if plan.get("resume_latest"):  # a local run (etrain run-local): no supervisor chooses
        from elastic.checkpoint.directory import CheckpointDir

        latest, _ = CheckpointDir(meta["checkpoint_dir"]).latest_valid()
        meta["resume_path"] = None if latest is None else latest.path
    worker = PipedWorker(
        rank=rank,
        world_size=world,
        config=WorkerConfig.from_dict(meta),
        supervisor=None,
        device=device,
        link=link,
    )
    try:
        run_with_context(train_loop, config, worker)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # not through torch's exit handlers, which may wait on lost peers
    dist.destroy_process_group()
    # Not through the interpreter's teardown either: a peer that ended first took rank 0's
    # store with it, and a store thread still joinable at static destruction aborts the
    # process (std::terminate, status 134) after the loop has ended well.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
