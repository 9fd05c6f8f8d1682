"""The torchrun elastic side of ``bench.recovery``: the same small job written the way a
torchrun user writes it, one node killed, one node added back.

Three torchrun agents (``python -m torch.distributed.run``, one worker each, ``--nnodes=1:3``,
c10d rendezvous on 127.0.0.1, each agent in its own process group standing for one node)
run DDP on Gloo: the small CNN on synthetic images, global batch ``batch`` split over the
world, a ``DistributedSampler``, a checkpoint (model, optimizer, step, epoch) every
``every`` steps written by rank 0, loaded by every worker on start. A resumed worker starts
its epoch over, as the stock recipe does, so the samples of the steps since the epoch began
are trained again: that is what is measured, not avoided.

Each worker appends one JSON line per finished step to its own file; the driver polls them.
Once step ``kill_at`` is seen, the node of rank 1 (its agent's process group and its worker)
is SIGKILLed; once a worker group started after the kill reaches ``grow_at``, a fourth agent
is started with the same arguments and torchrun restarts the workers at world 3. The records
go to ``bench.recovery_records.summarize`` like every other side's.

Which agent hosts what: one agent has ``is_host=true`` in its rendezvous config and hosts
the c10d rendezvous store; torchrun does not survive losing it, so the node killed is never
its. It is started last, so the other two already wait on its store and all three make the
first round (else the first agent up would start alone and the start would churn through
restarts at growing worlds). The rendezvous ranks nodes by address, then pid, so it is rank
2 and rank 1 is another node; the run stops with an error if rank 1 ever lands on it. The
agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torchrun's opt-out of sharing the
agent's store with the workers: with sharing on (the default in this torch), a node that
joins after the first round waits for the workers' store address under the new round's keys,
which the group's rank 0 wrote only in its first round, and the grow hangs; with it off,
every round publishes a fresh address and each worker group's rank 0 hosts its own store.

``attempt``: torchrun gives no value that all ranks of one worker group share (each agent
counts its own restarts; the rendezvous round is not exported), so rank 0 of every new
worker group draws an id and broadcasts it right after ``init_process_group``; the id reads
``w<world>-from<resumed step>-<random>``.

    .venv/bin/python -m bench.recovery_torchrun
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.recovery_job import indexed_images
from bench.recovery_records import StepRecord, summarize

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.02
DEADLINE_S = 600.0
MAX_NODES = 3
# The fast-recovery tuning: a rendezvous closes 1 s after it has its minimum (default 30 s);
# a node is dead after 3 s without a heartbeat (default 5 s x 3). Not 1 s x 2: a node's first
# beat after a round comes up to last_call + interval after its last one, and any node's
# sync that sees it older than the expiry drops it (itself included) from the round, which
# then lets a newcomer start a second job of its own.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


# --- the worker: what torchrun starts on every node ------------------------------------


def _die_with_agent() -> None:
    # torchrun starts workers in their own session, so a node's death (its agent's process
    # group killed) would leave the worker running; a real node takes its worker with it.
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _load_checkpoint(path: Path, model: Any, optimizer: Any) -> tuple[int, int]:
    import torch

    if not path.exists():
        return 0, 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), int(state["epoch"])


def _save_checkpoint(path: Path, model: Any, optimizer: Any, step: int, epoch: int) -> None:
    import torch

    tmp = path.with_suffix(f".tmp{os.getpid()}")
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "epoch": epoch,
    }
    torch.save(state, tmp)
    # A node killed mid-write must never leave a torn file where the next group looks.
    os.replace(tmp, path)


def _group_attempt(world: int, resumed: int) -> str:
    import torch.distributed as dist

    box = [f"w{world}-from{resumed}-{uuid.uuid4().hex[:8]}"]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def worker_main(records_dir: str, ckpt_dir: str, steps: int, batch: int, every: int) -> None:
    """One torchrun worker: DDP on Gloo, resume from the latest checkpoint, train to
    ``steps``, one JSON line per finished step."""
    _die_with_agent()
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from jobs.workloads.image_classification import SmallCNN

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SmallCNN(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = Path(ckpt_dir) / "latest.pt"
    step, epoch = _load_checkpoint(ckpt, model, optimizer)
    ddp = DistributedDataParallel(model)
    dataset = indexed_images()
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch // world, sampler=sampler)
    criterion = nn.CrossEntropyLoss()
    attempt = _group_attempt(world, step)
    out = Path(records_dir) / f"worker-{os.getpid()}.jsonl"
    with out.open("a", buffering=1) as log:
        while step < steps:
            sampler.set_epoch(epoch)
            for images, labels, indices in loader:
                optimizer.zero_grad()
                criterion(ddp(images), labels).backward()
                optimizer.step()
                step += 1
                line = {
                    "time": time.time(),
                    "rank": rank,
                    "step": step,
                    "attempt": attempt,
                    "world": world,
                    "indices": indices.tolist(),
                    "pid": os.getpid(),
                    "agent": os.getppid(),
                }
                log.write(json.dumps(line) + "\n")
                if rank == 0 and step % every == 0:
                    _save_checkpoint(ckpt, model, optimizer, step, epoch)
                if step >= steps:
                    break
            else:
                epoch += 1
    dist.destroy_process_group()


# --- the driver: the nodes, the kill, the node added back --------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Nodes:
    """The torchrun agents of one run, each in its own process group (one node each)."""

    work: Path
    port: int
    run_id: str
    worker_args: list[str]
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    worker_pids: set[int] = field(default_factory=set)

    def start(self, is_host: bool) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
        env |= {
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "LOGLEVEL": "INFO",  # start_all waits for the agents' launch line
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes=1:{MAX_NODES}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=is_host={str(is_host).lower()},{RDZV_CONF}",
            "--max-restarts=10",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
            "--module",
            "bench.recovery_torchrun",
            "worker",
            *self.worker_args,
        ]
        log = (self.work / f"agent-{len(self.agents)}.log").open("wb")
        with log:
            agent = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.agents.append(agent)
        return agent

    def start_all(self) -> None:
        """The non-host agents first, the host once they wait on its store: a node that comes
        up alone would start the job alone, and the start would churn through restarts."""
        waiting = [self.start(is_host=False) for _ in range(MAX_NODES - 1)]
        deadline = time.monotonic() + 120
        while not all(self._launched(i) for i in range(len(waiting))):
            if time.monotonic() > deadline or any(a.poll() is not None for a in waiting):
                raise RuntimeError(f"torchrun agents did not start\n{_log_tail(self.work)}")
            time.sleep(POLL_S)
        self.start(is_host=True)

    def _launched(self, i: int) -> bool:
        # torchrun logs its launch config just before it connects to the rendezvous store.
        log = (self.work / f"agent-{i}.log").read_bytes()
        return b"Starting elastic_operator" in log

    def kill_node(self, agent_pid: int, worker_pid: int) -> None:
        """SIGKILL one node: its agent's process group, and its worker's (torchrun starts
        each worker in a session of its own)."""
        _kill_group(agent_pid)
        if self._is_worker(worker_pid):
            _kill_group(worker_pid)

    def running(self) -> list[subprocess.Popen[bytes]]:
        return [a for a in self.agents if a.poll() is None]

    def kill_all(self) -> None:
        for agent in self.running():
            _kill_group(agent.pid)
        # Workers die with their agent (PDEATHSIG); this is for one that started before its
        # agent died and had not set it yet.
        for pid in self.worker_pids:
            if self._is_worker(pid):
                _kill_group(pid)
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=10)

    def _is_worker(self, pid: int) -> bool:
        # A worker of this run still alive, not a process that got its pid since.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"bench.recovery_torchrun\0worker\0" + self.worker_args[0].encode() in cmdline


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class RecordReader:
    """The workers' step lines, read incrementally (only complete lines) from every file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.lines: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("worker-*.jsonl")):
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            new += [json.loads(line) for line in chunk[:end].splitlines()]
        self.lines += new
        return new


def _rank1_node(lines: list[dict[str, Any]]) -> tuple[int, int]:
    """(agent pid, worker pid) of the latest record of rank 1."""
    last = max((r for r in lines if r["rank"] == 1), key=lambda r: r["time"])
    return int(last["agent"]), int(last["pid"])


def _log_tail(work: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
        for p in sorted(work.glob("agent-*.log"))
    )


def _drive(
    nodes: Nodes, reader: RecordReader, kill_at: int, grow_at: int
) -> tuple[float, float | None, int]:
    """Kill rank 1's node at ``kill_at``, add a node at ``grow_at``, wait for the end;
    returns (killed at, added at, the killed agent's pid)."""
    deadline = time.monotonic() + DEADLINE_S
    killed_at: float | None = None
    killed = 0
    added_at: float | None = None
    before_kill: set[str] = set()
    host = nodes.agents[-1].pid
    while nodes.running():
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun side not done in {DEADLINE_S} s\n{_log_tail(nodes.work)}")
        new = reader.poll()
        nodes.worker_pids |= {int(r["pid"]) for r in new}
        if killed_at is None and any(r["step"] >= kill_at for r in new):
            agent, worker = _rank1_node(reader.lines)
            if agent == host:
                raise RuntimeError("rank 1 is on the store host's node; it cannot be killed")
            nodes.kill_node(agent, worker)
            killed, killed_at = agent, time.time()
            before_kill = {r["attempt"] for r in reader.lines}
        elif (
            killed_at is not None
            and added_at is None
            and any(r["attempt"] not in before_kill and r["step"] >= grow_at for r in new)
        ):
            nodes.start(is_host=False)
            added_at = time.time()
        time.sleep(POLL_S)
    reader.poll()
    if killed_at is None:
        raise RuntimeError(f"step {kill_at} never seen\n{_log_tail(nodes.work)}")
    return killed_at, added_at, killed


def _check_exits(nodes: Nodes, killed: int) -> None:
    bad = [(a.pid, a.returncode) for a in nodes.agents if a.pid != killed and a.returncode != 0]
    if bad:
        raise RuntimeError(f"torchrun agents failed: {bad}\n{_log_tail(nodes.work)}")


def _records(lines: list[dict[str, Any]]) -> list[StepRecord]:
    return sorted(
        (
            StepRecord(
                r["time"], r["rank"], r["step"], r["attempt"], r["world"], True, tuple(r["indices"])
            )
            for r in lines
        ),
        key=lambda r: r.time,
    )


def run_torchrun(
    work_dir: str, steps: int, kill_at: int, grow_at: int, batch: int, every: int
) -> tuple[list[StepRecord], float, float, float | None]:
    """returns (records, started, killed_at, added_at)"""
    work = Path(work_dir) / f"torchrun-{uuid.uuid4().hex[:8]}"
    records_dir, ckpt_dir = work / "records", work / "checkpoints"
    records_dir.mkdir(parents=True)
    ckpt_dir.mkdir()
    args = [str(records_dir), str(ckpt_dir), str(steps), str(batch), str(every)]
    nodes = Nodes(work, _free_port(), f"bench-{work.name}", args)
    reader = RecordReader(records_dir)
    started = time.time()
    try:
        nodes.start_all()
        killed_at, added_at, killed = _drive(nodes, reader, kill_at, grow_at)
        _check_exits(nodes, killed)
    finally:
        nodes.kill_all()
    return _records(reader.lines), started, killed_at, added_at


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        records_dir, ckpt_dir, *figures = sys.argv[2:7]
        worker_main(records_dir, ckpt_dir, *(int(f) for f in figures))
        return
    import tempfile

    steps, kill_at, grow_at, batch, every = 300, 24, 60, 60, 10
    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as tmp:
        records, started, killed_at, added_at = run_torchrun(
            tmp, steps, kill_at, grow_at, batch, every
        )
    print(summarize(records, started, killed_at, added_at, steps, batch))


if __name__ == "__main__":
    main()
