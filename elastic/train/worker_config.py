"""What a training worker receives from its supervisor, typed and checked once.

The supervisor sends a plain dict as ``config["_elastic"]`` (it crosses Ray's pickling
and must stay readable by older and newer workers alike): the keys it sends today are
required, and every key added later has a default here, so either side can be upgraded
first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class WorkerConfigError(ValueError):
    pass


@dataclass(frozen=True)
class WorkerConfig:
    checkpoint_dir: str
    every_steps: int
    keep: int
    max_workers: int
    attempt: int = 1
    train_loop: str | None = None
    supervisor: str | None = None  # the supervisor actor's name; None: run without one
    namespace: str | None = None
    resume_path: str | None = None  # the verified checkpoint this attempt starts from

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep", "max_workers", "attempt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkerConfigError(f"_elastic.{name}: a positive integer, not {value!r}")
        if not self.checkpoint_dir:
            raise WorkerConfigError("_elastic.checkpoint_dir: missing")
        if self.supervisor and not self.namespace:
            raise WorkerConfigError("_elastic.namespace: needed to find the supervisor")

    @classmethod
    def from_dict(cls, meta: dict[str, Any]) -> WorkerConfig:
        known = {f.name for f in fields(cls)}
        missing = [
            k for k in ("checkpoint_dir", "every_steps", "keep", "max_workers") if k not in meta
        ]
        if missing:
            raise WorkerConfigError(f"_elastic: missing {', '.join(missing)}")
        # Keys a newer supervisor adds are ignored by this worker, not an error.
        values = {k: v for k, v in meta.items() if k in known}
        for name in ("every_steps", "keep", "max_workers", "attempt"):
            if name in values and isinstance(values[name], str) and values[name].isdigit():
                values[name] = int(values[name])
        return cls(**values)
