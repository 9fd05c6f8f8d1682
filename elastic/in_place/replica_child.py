"""An in-place replica of a job whose ``train_loop`` comes from its code package: the loop
runs in a confined child of the ``Replica`` actor (``python -m
elastic.in_place.replica_child PLAN``), never in the actor, which holds Ray.

The child builds the replica's torchft ``Manager`` itself: the Manager talks to the
lighthouse and to its peers over the network, which needs no Ray. It runs the loop with an
:class:`InPlaceContext` whose worker sends what it would tell the supervisor up a pipe; the
actor passes it on, and passes the supervisor's aborts, leaves and drain notices down
(elastic/in_place/child_link.py). The child ends with the loop and says how it ended.

The job's requirements are installed per replica, on its node, before its child starts: in
place no process group joins the replicas before their first quorum, so restart mode's
install, agreed over the workers' group, does not apply. Installs on one node share a cache
(``elastic.train.command_requirements``): concurrent ones each stage their own directory and
the first to finish is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PLAN_FILE = "replica-plan.json"


def run_package_loop(
    config: dict[str, Any],
    meta: dict[str, Any],
    worker: Any,
    supervisor: Any,
    replica: int,
    manager: dict[str, Any],
    on_relay: Callable[[Any], None],
) -> str:
    """Replica ``replica``'s loop in its child, until the child exits; returns its outcome.
    ``meta``: the loop's ``_elastic`` part (its resume path cleared for a replica that must
    heal); ``worker``: the actor's worker context, whose events reach the supervisor;
    ``manager``: what the child builds its Manager from (lighthouse, replica id, timeout,
    host, must_heal, starting); ``on_relay`` is given the relay before the child starts, for
    the actor's ``abort_step``, ``leave`` and ``expect_drain``."""
    from elastic.in_place.child_link import ReplicaRelay
    from elastic.train import command_env, command_limits, command_requirements
    from elastic.train.child_boot import child_argv
    from elastic.train.command import CommandPlan, _files_dir, _give, _working_directory
    from elastic.train.command_confinement import (
        confinement,
        unprivileged_uid,
        writing_checkpoints,
    )
    from elastic.train.command_process import start
    from elastic.train.entrypoint import EntrypointError
    from elastic.train.loop_link import child_config

    plan = CommandPlan.from_dict(config["command"])
    assert plan.entrypoint is not None
    uid = unprivileged_uid(plan.owner)
    files = _files_dir(plan, uid)
    added = {} if files is None else {command_env.CHECKPOINT_DIR_ENV: files}
    # Held to the job's CPUs and memory per worker as restart mode's child is; named per
    # replica, since a node may hold several replicas of the job.
    limits = command_limits.Limits(plan.cpus, plan.memory_gb)
    with (
        _working_directory(plan, uid) as workdir,
        command_limits.limited(f"{plan.job_id[:12]}-r{replica}", limits) as groups,
    ):
        env = command_env.child_environment(os.environ, str(workdir), added, plan.cpus)
        rules = confinement(workdir, files, uid, plan.data_roots)
        rules["cgroups"] = groups.procs_files
        args = command_requirements.pip_arguments(plan.requirements, workdir)
        if args:
            installed = _install_on_this_node(plan.owner, args, workdir, env, rules, uid)
            env["PYTHONPATH"] = str(installed)
            rules["read"].append(str(installed))
        # The context writes the job's checkpoints (and TensorBoard files, and the sample
        # audit) there itself.
        rules = writing_checkpoints(rules, str(meta["checkpoint_dir"]), uid)
        loop_config = {**child_config(config), "_elastic": meta}
        plan_file = workdir / ".tmp" / PLAN_FILE
        plan_file.write_text(
            json.dumps(
                {
                    "entrypoint": plan.entrypoint,
                    "config": loop_config,
                    "replica": replica,
                    "rank": worker.rank,
                    **manager,
                }
            )
        )
        _give(plan_file, uid)
        relay = ReplicaRelay(worker, supervisor, worker.attempt, replica)
        on_relay(relay)
        argv = child_argv("elastic.in_place.replica_child", str(plan_file))
        running = start(argv, workdir, env, rules, None, on_line=relay.line, replies=True)
        assert running.replies is not None
        relay.attach(running.replies)
        try:
            code = running.process.wait()
        finally:
            running.stop(0)
            running.join()  # its last lines (the outcome) read
        memory = groups.memory_message() if code != 0 else None
    if memory is not None:  # the kernel killed it at the job's memory limit
        raise RuntimeError(f"replica {replica}: {memory}")
    if relay.code_error is not None:
        raise EntrypointError(relay.code_error)
    if code != 0:
        how = f"signal {code - 128}" if code > 128 else f"status {code}"
        last = " | ".join(line.strip() for line in running.stderr_tail if line.strip())
        raise RuntimeError(
            f"replica {replica}'s loop process exited with {how}" + (f": {last}" if last else "")
        )
    if relay.outcome is None:
        raise RuntimeError(f"replica {replica}'s loop process ended without saying how")
    return relay.outcome


def _install_on_this_node(
    owner: str,
    args: list[str],
    workdir: Path,
    env: dict[str, str],
    rules: dict[str, Any],
    uid: int | None,
) -> Path:
    """The job's requirements on this node: the cached install, or pip's into a staging
    directory of this replica's own, published unless another finished first."""
    from elastic.train import command_requirements as requirements
    from elastic.train.command_process import start

    key = requirements.install_key(owner, args, workdir)
    final = requirements.DEPS_ROOT / key
    if final.is_dir():
        print("[elastic-train] requirements: installed on this node already", flush=True)
        return final
    stage, final = requirements.staging(key, uid)
    print(f"[elastic-train] installing the requirements: pip install {' '.join(args)}", flush=True)
    pip_rules = {**rules, "write": [*rules["write"], str(stage)]}
    running = start(requirements.pip_command(stage, args), workdir, env, pip_rules, None)
    try:
        code = running.process.wait()
    finally:
        running.stop(0)
        running.join()
    if code != 0:
        shutil.rmtree(stage, ignore_errors=True)
        raise RuntimeError(
            f"installing the requirements failed (pip exited with {code}): "
            + " | ".join(running.stderr_tail)
        )
    requirements.publish(stage, final)
    return final


def main(argv: list[str]) -> int:
    """The child: load the loop, build the replica's Manager, run, say how it ended."""
    from elastic.in_place.child_link import ReplicaChildWorker, ReplicaControl
    from elastic.train.command_env import REPLY_FD_ENV
    from elastic.train.entrypoint import EntrypointError
    from elastic.train.loop_child import CODE_ERROR_EXIT, load
    from elastic.train.loop_link import ParentLink

    plan = json.loads(Path(argv[1]).read_text())
    control = ReplicaControl()
    link = control.link = ParentLink.from_environment(control.handle)
    control.watch_parent(int(os.environ[REPLY_FD_ENV]))
    try:
        train_loop = load(plan["entrypoint"], Path.cwd())
    except EntrypointError as e:
        link.send({"code_error": str(e)})
        print(e, file=sys.stderr, flush=True)
        return CODE_ERROR_EXIT

    import torch

    from elastic.in_place.context import InPlaceContext, LeftTheQuorum
    from elastic.in_place.manager import START_TOGETHER_S, make_manager, wait_for_starters
    from elastic.train.current import call_train_loop
    from elastic.train.worker_config import WorkerConfig

    config: dict[str, Any] = plan["config"]
    lighthouse = str(plan["lighthouse"])
    worker = ReplicaChildWorker(
        rank=int(plan["rank"]),
        world_size=1,
        config=WorkerConfig.from_dict(config["_elastic"]),
        supervisor=None,
        device=torch.device("cpu"),  # in place runs on CPU workers
        link=link,
    )

    def factory(load_state: Any, save_state: Any) -> Any:
        return make_manager(
            load_state,
            save_state,
            lighthouse=lighthouse,
            replica_id=str(plan["replica_id"]),
            timeout_s=float(plan["timeout_s"]),
            host=str(plan["host"]),
        )

    def start_together() -> None:
        wait_for_starters(lighthouse, int(plan["starting"]), START_TOGETHER_S)

    ctx = InPlaceContext(
        config,
        worker,
        factory,
        int(plan["replica"]),
        bool(plan["must_heal"]),
        start_together,
        tell_trained=lambda: link.send({"call": "replica_trained"}),
    )
    control.attach(ctx)
    try:
        try:
            call_train_loop(train_loop, config, ctx)
            ctx.finish_steps()  # a step trained after the loop left ctx.batches
            ctx.checkpoints.wait()
            outcome = "finished" if worker.rank == 0 else "finished as a replica"
        except LeftTheQuorum:
            outcome = "left"
        finally:
            # Its TensorBoard points, before the manager stops heartbeating: a replica whose
            # heartbeats stop is fenced as lost.
            worker.close()
            if ctx.manager is not None:
                ctx.manager.shutdown(wait=False)
        link.send({"outcome": outcome})
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # not through torch's exit handlers, which may wait on lost peers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
