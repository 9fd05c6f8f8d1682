"""What a checkpoint holds, as a registry of parts that save and restore themselves.

Each part (model, optimizer, LR schedule, grad scaler, sampler position, step, the loop's
own state, random generators) is registered once under a name, where it is built; saving
asks every registered part for its state and restoring hands each part its own. A part is
*replicated* (the same on every rank: rank 0 writes it into ``state.pt``) or *sharded*
(each rank holds a piece: every rank writes its piece with ``torch.distributed.checkpoint``,
which reads back at any world size).

Everything a part returns must load with ``torch.load(weights_only=True)``: tensors,
numbers, strings, and lists, tuples and dicts of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from elastic.train.distributed import unwrap


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class Value:
    """A part made of a getter and a setter (a counter, a position, a dict)."""

    get: Callable[[], Any]
    set: Callable[[Any], None]

    def state_dict(self) -> Any:
        return self.get()

    def load_state_dict(self, state: Any) -> None:
        self.set(state)


class ReplicatedModel:
    """A model whose every rank holds all of it (DDP, local SGD, one worker)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> Any:
        return unwrap(self.model).state_dict()

    def load_state_dict(self, state: Any) -> None:
        unwrap(self.model).load_state_dict(state)


class ReplicatedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.optimizer.load_state_dict(state)


class ShardedModel:
    """FSDP's model: this rank's shards, named by the full model's parameter names (the
    layout ``torch.distributed.checkpoint`` reshards from)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class ShardedOptimizer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


# -- random generators ----------------------------------------------------------------------


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """A seed of its own for each rank (dropout noise must not be the same on every rank),
    fixed by the job's seed; ``step`` gives a rank that joins later a fresh stream."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    s = rank_seed(seed, rank, step)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)  # CUDA's generators too


def rng_streams() -> dict[str, Any]:
    """This process's generators, in types ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def set_rng_streams(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RankRng:
    """Every rank's generators: saved as one list indexed by rank (gathered at the
    checkpoint), each rank restoring its own. A rank the checkpoint did not have (the job
    grew) starts a stream of its own from (seed, rank, step)."""

    def __init__(
        self,
        rank: int,
        seed: int,
        step: Callable[[], int],
        gather: Callable[[Any], list[Any]],
    ) -> None:
        self.rank, self.seed, self.step, self.gather = rank, seed, step, gather

    def state_dict(self) -> Any:
        return {"per_rank": self.gather(rng_streams())}

    def load_state_dict(self, state: Any) -> None:
        per_rank = state.get("per_rank") if isinstance(state, Mapping) else None
        if per_rank and self.rank < len(per_rank):
            set_rng_streams(per_rank[self.rank])
        else:
            seed_rank(self.seed, self.rank, self.step())


# -- the registry ---------------------------------------------------------------------------


class CheckpointState:
    """The parts registered so far, and what the checkpoint being resumed holds for them."""

    def __init__(
        self,
        restored: Mapping[str, Any] | None,
        load_sharded: Callable[[str, Any], Any] | None = None,
    ) -> None:
        self.restored = restored
        # (name, the part's current state as a template) -> its state from the checkpoint
        self.load_sharded = load_sharded
        self.replicated: dict[str, Stateful] = {}
        self.sharded: dict[str, Stateful] = {}

    def register(self, name: str, part: Stateful, *, sharded: bool = False) -> bool:
        """Add a part, restoring it from the checkpoint when that holds it; True if so."""
        if name in self.replicated or name in self.sharded:
            raise ValueError(f"checkpoint part {name!r} registered twice")
        (self.sharded if sharded else self.replicated)[name] = part
        if self.restored is None:
            return False
        if sharded and self.load_sharded is not None and name not in self.restored:
            part.load_state_dict(self.load_sharded(name, part.state_dict()))
            return True
        if name in self.restored and self.restored[name] is not None:
            part.load_state_dict(self.restored[name])
            return True
        return False

    def replicated_state(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.replicated.items()}

    def sharded_state(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.sharded.items()}
