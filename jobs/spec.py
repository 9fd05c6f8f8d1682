"""JobSpec: what a user asks for, validated at the edge with a message naming each field."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from elastic.cluster.scheduling import DEFAULT_PRIORITY, PRIORITY_CLASSES
from elastic.train.command_env import FRAMEWORKS, PYTORCH
from jobs.validation import field_error, prefixed
from jobs.workloads import WORKLOADS

# "package.module:function", identifiers only: nothing that a shell or eval could interpret.
ENTRYPOINT_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
# In a code package an entrypoint may also name a file of it: "train.py:train_loop",
# "src/trainer/loop.py:train_loop" (relative, no "..": the package is checked on upload).
PACKAGE_FILE_ENTRYPOINT = re.compile(r"^(?!.*(^|/)\.\.(/|:))[\w.\-]+(/[\w.\-]+)*\.py:[A-Za-z_]\w*$")
# How deeply a custom workload's hyperparameters may nest: far more than any configuration
# needs, and far less than what breaks serialisation (Python's recursion limit).
MAX_HYPERPARAMETER_DEPTH = 32
# The numbers a job's priority may be: the named classes sit inside, so that a job can be
# put just above or below one of them (51: ahead of every "normal" job).
MIN_PRIORITY, MAX_PRIORITY = 0, 1000
PriorityClass = Literal["low", "normal", "high"]
# What a command job's ``workload`` reads: its ``command`` is what runs.
COMMAND_WORKLOAD = "command"


def _requirement(text: str) -> str:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        Requirement(text)
    except InvalidRequirement as e:
        raise ValueError(
            f"not a requirement pip takes (PEP 508): {str(e).splitlines()[0]}"
        ) from None
    return text


RequirementSpec = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_requirement)]
CommandArgument = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


def priority_value(priority: int | str | None) -> int:
    """The number of a priority as a spec gives it (a class name or a number); a spec stored
    before priorities existed has none, and ran as "normal"."""
    if priority is None:
        return DEFAULT_PRIORITY
    if isinstance(priority, str):
        return PRIORITY_CLASSES[priority]
    return int(priority)


def nesting_depth(value: Any) -> int:
    """Levels of dicts and lists in ``value`` (0 for a plain value); without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


class ScalingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_workers: int = Field(1, ge=1, le=1024, description="Fewest workers the job runs with.")
    max_workers: int = Field(1, ge=1, le=1024, description="Most workers the job runs with.")
    cpus_per_worker: float = Field(1.0, gt=0, le=512)
    memory_per_worker_gb: float | None = Field(
        None,
        gt=0,
        le=16_384,
        description="GiB of memory each worker's command may use (a command or a package's "
        "train_loop); above it the kernel kills the command, not the node's other "
        "processes. None: no limit.",
    )
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


class DistributedSpec(BaseModel):
    """How the workers train together. Options a job's hardware cannot run are refused at
    submission (see ``JobSpec``), not when the workers start."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend: auto is NCCL when workers have GPUs, else Gloo."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every worker holds the whole model; fsdp: parameters, "
        "gradients and optimizer state are sharded across the workers.",
    )
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none",
        description="A DDP communication hook that compresses gradients before they are averaged.",
    )
    powersgd_rank: int = Field(
        1, ge=1, le=1024, description="Rank of PowerSGD's low-rank gradient approximation."
    )
    powersgd_start_step: int = Field(
        2,
        ge=2,
        le=100_000_000,
        description="Optimizer steps averaged exactly before PowerSGD starts compressing.",
    )
    bucket_cap_mb: float = Field(
        25.0,
        gt=0,
        le=4096,
        description="DDP gradient bucket size: smaller buckets start "
        "communicating earlier during the backward pass.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="fp32; bf16 autocast (CPU or GPU); fp16 autocast with a gradient "
        "scaler (GPU only).",
    )
    sync: Literal["every_step", "local_sgd"] = Field(
        "every_step",
        description="every_step: gradients averaged every step; local_sgd: "
        "workers step on their own gradients and average parameters every local_sgd_period "
        "steps.",
    )
    local_sgd_period: int = Field(
        8, ge=1, le=1_000_000, description="H: the steps between parameter averages."
    )


def _why_not_in_place(strategy: str, sync: str, compression: str, gpus: int) -> str | None:
    """Why a job with these options cannot recover in place (None: it can)."""
    if strategy == "fsdp":
        return (
            "in_place recovery needs every worker to hold the whole model (a peer heals a "
            "joiner): use strategy ddp with it, or fault_tolerance restart with fsdp"
        )
    if sync == "local_sgd":
        return (
            "in_place recovery averages gradients every step: use sync every_step with "
            "it, or fault_tolerance restart with local_sgd"
        )
    if compression != "none":
        return (
            "in_place recovery averages exact gradients: use gradient_compression none "
            "with it, or fault_tolerance restart"
        )
    if gpus > 0:
        # Its replicas train on CPU with Gloo: torchft's NCCL path has not run on a GPU here.
        return (
            "in_place recovery runs on CPU workers in this release: use fault_tolerance "
            "restart with scaling.gpus_per_worker above 0"
        )
    return None


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[\w][\w .\-]*$")
    workload: str = Field(
        description="A built-in workload (" + ", ".join(sorted(WORKLOADS)) + ") or a custom "
        "entrypoint 'package.module:function'. Left out for a command job (it then reads "
        f"{COMMAND_WORKLOAD!r}).",
        min_length=1,
        max_length=256,
    )
    command: list[CommandArgument] | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="A command every worker runs as it is, with the environment torchrun "
        "gives a worker (RANK, WORLD_SIZE, MASTER_ADDR, ...) and ETRAIN_CHECKPOINT_DIR, in "
        'the job\'s code package: e.g. ["python", "train.py", "--epochs", "3"]. '
        "It recovers by restart: on a node loss or a grow every process is stopped and the "
        "command starts again at the new size, resuming from its own checkpoint.",
    )
    code: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="The id of the job's code package (POST /v1/code, or etrain submit "
        "--code DIR): the command's working directory on every worker.",
    )
    requirements: list[RequirementSpec] = Field(
        default_factory=list,
        max_length=100,
        description="Packages a command job's processes need (PEP 508, as pip takes them: "
        "'numpy>=2', 'tensorflow==2.*'), installed on each node before the command, with the "
        "package's requirements.txt.",
    )
    stop_grace_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="A command job's processes stopped for a grow get this long between "
        "SIGTERM and SIGKILL to save a checkpoint.",
    )
    framework: str = Field(
        PYTORCH,
        description="What a command job's processes are set up for, besides torchrun's "
        "environment: " + ", ".join(FRAMEWORKS) + ". tensorflow also gives each process "
        "the TF_CONFIG that tf.distribute.MultiWorkerMirroredStrategy reads.",
    )
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)
    fault_tolerance: Literal["in_place", "restart"] | None = Field(
        None,
        description="in_place: the surviving workers train on through a node loss and new "
        "workers join at a step boundary, healed from a peer (DDP on CPU workers, every "
        "step's gradients averaged exactly); restart: the job restarts its workers from the "
        "latest checkpoint at the new size (FSDP, local SGD, gradient compression, GPUs). "
        "Left out: in_place where the job's options allow it, restart otherwise; the job's "
        "spec then says which it got.",
    )
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] | PriorityClass = Field(
        "normal",
        description="Which jobs the scheduler serves first: low (0), normal (50), high (100), "
        f"or a number from {MIN_PRIORITY} to {MAX_PRIORITY}. Only an admin may submit a job "
        "above normal.",
    )

    @property
    def priority_value(self) -> int:
        """The priority as the scheduler orders jobs by it (a class name as its number)."""
        return priority_value(self.priority)

    @property
    def recovery_mode(self) -> Literal["in_place", "restart"]:
        """How the job recovers: what it asked for, else in place where its options allow it.
        Decided here alone; the launcher and the supervisor take it from this."""
        if self.fault_tolerance is not None:
            return self.fault_tolerance
        if self.runs_package_loop:
            # In place, a package loop's replicas run it in confined children: asked for,
            # it is had (the options below decide whether it may be); restart stays the
            # default until it is proven as widely as restart mode's child.
            return "restart"
        return "restart" if self._why_not_in_place() else "in_place"

    def _why_not_in_place(self) -> str | None:
        if self.command is not None:
            return (
                "a command job recovers by restart: its processes start again at the new "
                "size and resume from their own checkpoint (torchrun's elastic contract)"
            )
        # A train_loop from a code package recovers in place as a built-in loop does (its
        # replicas' confined children build the torchft managers): the same options decide.
        d = self.distributed
        return _why_not_in_place(
            d.strategy, d.sync, d.gradient_compression, self.scaling.gpus_per_worker
        )

    @property
    def is_custom(self) -> bool:
        """A custom entrypoint's ``module:function`` installed on the workers (not a
        built-in, not a command, not in a code package)."""
        return self.command is None and self.code is None and self.workload not in WORKLOADS

    @property
    def runs_package_loop(self) -> bool:
        """A ``train_loop`` of the job's code package, run in a confined child."""
        return self.command is None and self.code is not None

    @property
    def runs_user_code(self) -> bool:
        """Code the owner sent runs: a command, or a loop of a code package."""
        return self.command is not None or self.code is not None

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        if self.distributed.backend == "auto":
            return self.scaling.backend
        return self.distributed.backend

    def data_paths(self) -> list[tuple[str, str]]:
        """(``hyperparameters.<field>``, path) of every file or directory the job reads."""
        workload = WORKLOADS.get(self.workload)
        fields = workload.path_fields if workload else ()
        return [
            (f"hyperparameters.{name}", str(self.hyperparameters[name]))
            for name in fields
            if self.hyperparameters.get(name) is not None
        ]

    def with_data_paths(self, paths: dict[str, str]) -> JobSpec:
        """This spec with the given ``hyperparameters.<field>`` paths replaced."""
        hyper = dict(self.hyperparameters)
        for field, path in paths.items():
            hyper[field.removeprefix("hyperparameters.")] = path
        return self.model_copy(update={"hyperparameters": hyper})

    def train_config(self) -> dict[str, Any]:
        """What every worker's ``train_loop(config, ctx)`` receives."""
        return {
            "hyperparameters": self.hyperparameters,
            "distributed": self.distributed.model_dump(),
        }

    @field_validator("priority", mode="before")
    @classmethod
    def _one_priority(cls, value: Any) -> Any:
        # One message for every wrong value, not one per member of the union (a number's
        # range and the names' list), and no bool or "100" taken for a number.
        if isinstance(value, bool) or not (
            (isinstance(value, int) and MIN_PRIORITY <= value <= MAX_PRIORITY)
            or (isinstance(value, str) and value in PRIORITY_CLASSES)
        ):
            raise PydanticCustomError(
                "priority",
                f"must be one of {', '.join(PRIORITY_CLASSES)} or an integer from "
                f"{MIN_PRIORITY} to {MAX_PRIORITY}",
            )
        return value

    @field_validator("framework")
    @classmethod
    def _known_framework(cls, value: str) -> str:
        if value not in FRAMEWORKS:
            raise PydanticCustomError(
                "framework",
                f"unknown framework {value!r}: use one of {', '.join(FRAMEWORKS)} (for a "
                "Horovod script, see docs/horovod.md)",
            )
        return value

    @field_validator("hyperparameters")
    @classmethod
    def _not_too_deep(cls, value: dict[str, Any]) -> dict[str, Any]:
        depth = nesting_depth(value)
        if depth > MAX_HYPERPARAMETER_DEPTH:
            raise ValueError(
                f"nested {depth} levels deep; at most {MAX_HYPERPARAMETER_DEPTH} are allowed"
            )
        return value

    @model_validator(mode="after")
    def _check_distributed(self) -> JobSpec:
        """Refuse at submission what the job's hardware or the other options rule out."""
        d, gpus = self.distributed, self.scaling.gpus_per_worker

        def refuse(name: str, message: str, value: Any) -> ValidationError:
            return field_error("JobSpec", f"distributed.{name}", message, value)

        if d.backend == "nccl" and gpus == 0:
            raise refuse(
                "backend",
                "nccl needs GPUs: set scaling.gpus_per_worker above 0, "
                "or use backend auto or gloo on CPU workers",
                d.backend,
            )
        if d.precision == "fp16" and gpus == 0:
            raise refuse(
                "precision",
                "fp16 needs GPUs (its gradient scaler is CUDA's): set "
                "scaling.gpus_per_worker above 0, or use bf16 or fp32 on CPU "
                "workers",
                d.precision,
            )
        if d.strategy == "fsdp" and d.gradient_compression != "none":
            raise refuse(
                "gradient_compression",
                "gradient compression hooks are DDP's: use "
                "strategy ddp, or gradient_compression none with fsdp",
                d.gradient_compression,
            )
        if d.strategy == "fsdp" and d.sync == "local_sgd":
            raise refuse(
                "sync",
                "local_sgd needs every worker to hold the whole model: use strategy ddp with it",
                d.sync,
            )
        if d.sync == "local_sgd" and d.gradient_compression != "none":
            raise refuse(
                "gradient_compression",
                "with local_sgd no gradients are communicated, so there is nothing to compress",
                d.gradient_compression,
            )
        if d.sync == "local_sgd" and self.checkpoint.every_steps % d.local_sgd_period:
            raise refuse(
                "local_sgd_period",
                f"checkpoint.every_steps "
                f"({self.checkpoint.every_steps}) must be a multiple of "
                f"local_sgd_period ({d.local_sgd_period}), so that every checkpoint "
                "holds the averaged model",
                d.local_sgd_period,
            )
        why_not = self._why_not_in_place()
        if self.fault_tolerance == "in_place" and why_not:
            raise field_error("JobSpec", "fault_tolerance", why_not, self.fault_tolerance)
        self.fault_tolerance = self.recovery_mode
        if d.precision != "fp32" and self.hyperparameters.get("dtype") == "float64":
            raise refuse(
                "precision",
                f"precision {d.precision} with hyperparameters.dtype "
                "float64: mixed precision needs float32 parameters",
                d.precision,
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _one_program(cls, data: Any) -> Any:
        """A job runs a workload or a command: one of them, named; before the fields'
        own checks, so that a command job's recovery mode is decided with it."""
        if not isinstance(data, dict):
            return data
        if "entrypoint" in data:  # another name for a loop's workload
            if data.get("workload") is not None:
                raise field_error("JobSpec", "entrypoint", "give entrypoint or workload, not both")
            data = {**data, "workload": data["entrypoint"]}
            del data["entrypoint"]
        workload, command = data.get("workload"), data.get("command")
        if command is None:
            if workload is None:
                raise field_error(
                    "JobSpec",
                    "workload",
                    "missing: give a workload (built-in or 'package.module:function') or a command",
                )
            if workload == COMMAND_WORKLOAD:
                raise field_error(
                    "JobSpec",
                    "command",
                    f"missing: workload {COMMAND_WORKLOAD!r} runs the spec's command",
                )
            if data.get("requirements") and data.get("code") is None:
                raise field_error(
                    "JobSpec",
                    "requirements",
                    "requirements are installed for a job's code package: give code (etrain "
                    "submit --code DIR), or install them on the workers",
                    data.get("requirements"),
                )
            if data.get("code") is not None and workload in WORKLOADS:
                raise field_error(
                    "JobSpec",
                    "code",
                    'a code package runs a command (command: ["python", "train.py"]) or '
                    'a train_loop of the package (workload: "train.py:train_loop"), not the '
                    f"built-in workload {workload!r}",
                    data.get("code"),
                )
            # Only a value that asks for something: a stored spec of any job says pytorch.
            if data.get("framework") not in (None, PYTORCH):
                raise field_error(
                    "JobSpec",
                    "framework",
                    "framework sets up a command job's processes: give command, e.g. "
                    '["python", "train.py"]',
                    data.get("framework"),
                )
            return data
        if workload not in (None, COMMAND_WORKLOAD):
            raise field_error(
                "JobSpec",
                "command",
                "give a workload or a command, not both",
                command,
            )
        return {**data, "workload": COMMAND_WORKLOAD}

    def _check_loop_args(self) -> None:
        """A package loop written as a script's ``main()`` parses ``hyperparameters.args``
        as its ``sys.argv``: strings only, as a command's are."""
        args = self.hyperparameters.get("args")
        if args is not None and (
            not isinstance(args, list) or not all(isinstance(a, str) for a in args)
        ):
            raise field_error(
                "JobSpec",
                "hyperparameters.args",
                "a loop's arguments (its sys.argv) are a list of strings",
                args,
            )

    @model_validator(mode="after")
    def _check_workload(self) -> JobSpec:
        if self.command is not None:
            return self
        workload = WORKLOADS.get(self.workload)
        if workload is None:
            if self.code is not None:
                if not (
                    ENTRYPOINT_PATTERN.match(self.workload)
                    or PACKAGE_FILE_ENTRYPOINT.match(self.workload)
                ):
                    raise field_error(
                        "JobSpec",
                        "workload",
                        f"{self.workload!r} is not a train_loop of the package: name a file "
                        "and function ('train.py:train_loop') or a module of the package and "
                        "function ('trainer.loop:train_loop')",
                        self.workload,
                    )
                self._check_loop_args()
                return self
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
