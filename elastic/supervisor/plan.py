"""What a job's supervisor is told to run: fixed for the supervisor's life."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from elastic.job_state import JobState

# A lost peer must surface as an error in seconds, not after torch's 30-minute default.
COLLECTIVE_TIMEOUT_S = 30


@dataclass
class SupervisorPlan:
    job_id: str
    train_loop: str  # "module:function" run by every worker
    train_config: dict[str, Any]
    min_workers: int
    max_workers: int
    resources_per_worker: dict[str, float]
    backend: str  # "gloo" or "nccl"
    checkpoint_dir: str
    every_steps: int
    keep: int
    max_restarts: int
    min_workers_grace_s: float
    actor_name: str
    namespace: str
    # "in_place": survivors train on through a node loss (elastic/in_place); "restart": a new
    # worker group from the latest checkpoint. The job's spec decides it (JobSpec).
    fault_tolerance: Literal["in_place", "restart"]
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S
    initial_state: JobState = JobState.QUEUED
    # Set when the service re-creates the supervisor of a job whose supervisor died: what the
    # store knew of the job then.
    recreated: bool = False
    last_step: int = 0
    last_world_size: int = 0
    # Per sender of numbered news (elastic/arrivals.py), the last number the service stored:
    # a replica that outlived the dead supervisor sends its recent news again, and this much
    # of it is not taken twice.
    delivered: dict[str, int] = field(default_factory=dict)
    # Attempts are numbered from here: a re-created supervisor starts above every number
    # its predecessor can have used, so that no two attempts of a job share one.
    first_attempt: int = 1
    # What the cluster's scheduler orders jobs by: whose job, how urgent, and since when.
    owner: str = ""
    priority: int = 50
    submitted_at: float = 0.0
    # The job's code keeps its own checkpoints (a command job): none of ours tell its
    # progress, so an attempt that gets further than any before it is progress.
    own_checkpoints: bool = False
    # The workers start in the nodes' ready processes (elastic/warm_processes.py): they are
    # created with the runtime env of those processes.
    ready_processes: bool = True
