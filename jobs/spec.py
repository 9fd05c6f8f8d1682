"""JobSpec: what a user asks for, validated at the edge with a message naming each field."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jobs.validation import field_error, prefixed
from jobs.workloads import WORKLOADS

# "package.module:function", identifiers only: nothing that a shell or eval could interpret.
ENTRYPOINT_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class ScalingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_workers: int = Field(1, ge=1, le=1024, description="Fewest workers the job runs with.")
    max_workers: int = Field(1, ge=1, le=1024, description="Most workers the job runs with.")
    cpus_per_worker: float = Field(1.0, gt=0, le=512)
    gpus_per_worker: int = Field(
        0, ge=0, le=16, description="GPUs per worker; above 0 the job uses NCCL, else Gloo."
    )

    @model_validator(mode="after")
    def _check(self) -> ScalingSpec:
        if self.min_workers > self.max_workers:
            raise field_error(
                "ScalingSpec",
                "min_workers",
                f"min_workers ({self.min_workers}) must not exceed max_workers "
                f"({self.max_workers})",
                self.min_workers,
            )
        return self

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        return "nccl" if self.gpus_per_worker > 0 else "gloo"

    def worker_resources(self) -> dict[str, float]:
        resources = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            resources["GPU"] = float(self.gpus_per_worker)
        return resources


class CheckpointSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every_steps: int = Field(100, ge=1, le=10_000_000, description="Steps between checkpoints.")
    keep: int = Field(3, ge=1, le=1000, description="How many of the newest checkpoints to keep.")


class FailureSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_restarts: int = Field(3, ge=0, le=10_000, description="Restarts before the job fails.")
    min_workers_grace_s: float = Field(
        300.0,
        ge=0,
        le=7 * 24 * 3600,
        description="How long a job that lost workers waits for min_workers to fit again "
        "before it fails.",
    )


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[\w][\w .\-]*$")
    workload: str = Field(
        description="A built-in workload (" + ", ".join(sorted(WORKLOADS)) + ") or a custom "
        "entrypoint 'package.module:function'.",
        min_length=1,
        max_length=256,
    )
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)  # type: ignore[arg-type]
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)  # type: ignore[arg-type]
    failure: FailureSpec = Field(default_factory=FailureSpec)  # type: ignore[arg-type]

    @property
    def is_custom(self) -> bool:
        return self.workload not in WORKLOADS

    @model_validator(mode="after")
    def _check_workload(self) -> JobSpec:
        workload = WORKLOADS.get(self.workload)
        if workload is None:
            if not ENTRYPOINT_PATTERN.match(self.workload):
                raise field_error(
                    "JobSpec",
                    "workload",
                    f"unknown workload {self.workload!r}: use one of "
                    f"{', '.join(sorted(WORKLOADS))} or a 'package.module:function' entrypoint",
                    self.workload,
                )
            return self
        try:
            params = workload.hyperparameters.model_validate(self.hyperparameters)
        except ValidationError as e:
            raise prefixed("JobSpec", "hyperparameters", e) from None
        # Store the normalised form: defaults filled in, so a job's record is complete.
        self.hyperparameters = params.model_dump()
        batch = self.hyperparameters.get("global_batch_size")
        if isinstance(batch, int) and batch < self.scaling.max_workers:
            raise field_error(
                "JobSpec",
                "hyperparameters.global_batch_size",
                f"global_batch_size ({batch}) must be at least max_workers "
                f"({self.scaling.max_workers}) so that every worker gets a sample",
                batch,
            )
        return self
