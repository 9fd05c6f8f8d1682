"""A lower bound of the memory one worker of a built-in workload needs, from its
hyperparameters alone, so that a spec that could never fit on any node is refused at
submission instead of taking the cluster down when its workers start.

It counts what cannot be avoided: parameters, their gradients and the optimizer's state
(sharded across the most workers under FSDP), the activations that the backward pass keeps
for one micro-batch, the inputs of one step's share, and the data set held in memory. The
per-pixel activation counts are those of each model's forward pass at 224 px (the outputs of
its leaf modules; ``tests/unit/jobs/test_limits_units.py`` measures them again). It is a floor,
not a prediction: a job under it may still not fit, one over it certainly does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# model -> (parameters without the classifier, classifier inputs, activation elements per
# input pixel per sample)
IMAGE_MODELS: dict[str, tuple[int, int, float]] = {
    "resnet18": (11_176_512, 512, 149.0),
    "resnet34": (21_284_672, 512, 224.0),
    "resnet50": (23_508_032, 2048, 638.5),
    "mobilenet_v3_small": (1_517_856, 1024, 81.8),
    "efficientnet_b0": (4_007_548, 1280, 396.0),
    "small_cnn": (5_088, 32, 52.0),
}
CIFAR10_IMAGES = 60_000
GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, float]  # bytes, by what needs them

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = ", ".join(f"{name} {b / GIB:.2f}" for name, b in self.parts.items() if b)
        return f"at least {self.total / GIB:.2f} GiB per worker ({shown} GiB)"


def _optimizer_states(workload: str, hp: Mapping[str, Any]) -> int:
    if workload == "text-classification":
        return 2  # AdamW: two moments per parameter
    return 1 if hp.get("momentum", 0.9) > 0 else 0  # SGD's momentum buffer


def _training_state(
    parameters: int, states: int, element_bytes: int, distributed: Mapping[str, Any], most: int
) -> dict[str, float]:
    shards = most if distributed.get("strategy") == "fsdp" else 1
    weights = parameters * element_bytes / shards
    return {
        "parameters": weights,
        "gradients": weights,
        "optimizer state": weights * states,
    }


def estimate(spec: Any) -> MemoryEstimate | None:
    """The floor for ``spec`` (a ``jobs.spec.JobSpec``), or None for a custom workload,
    whose needs only its code knows."""
    hp, workload = spec.hyperparameters, spec.workload
    most = spec.scaling.max_workers
    distributed = spec.distributed.model_dump()
    micro = math.ceil(hp.get("global_batch_size", 1) / most)
    precision = distributed.get("precision", "fp32")
    if workload == "image-classification":
        backbone, head_in, per_pixel = IMAGE_MODELS[hp["model"]]
        classes = int(hp["num_classes"])
        element = 8 if hp.get("dtype") == "float64" else 4
        activation = 2 if precision in ("bf16", "fp16") else element
        pixels = int(hp["image_size"]) ** 2
        parameters = backbone + head_in * classes + classes
        parts = _training_state(
            parameters, _optimizer_states(workload, hp), element, distributed, most
        )
        parts["activations"] = per_pixel * pixels * micro * activation
        parts["inputs"] = 3 * pixels * micro * element
        if hp.get("dataset") == "synthetic":
            parts["data"] = classes * 3 * pixels * 4  # one pattern per class
        elif hp.get("dataset") == "cifar10":
            parts["data"] = CIFAR10_IMAGES * 3 * 32 * 32
        return MemoryEstimate(parts)
    if workload == "text-classification":
        width, layers, length = int(hp["width"]), int(hp["layers"]), int(hp["max_length"])
        ffn = int(hp.get("ffn_width") or 4 * width)
        per_layer = 4 * width * width + 2 * width * ffn + ffn + 9 * width
        parameters = (int(hp["vocab_size"]) + length) * width + layers * per_layer + 2 * width
        parts = _training_state(parameters, _optimizer_states(workload, hp), 4, distributed, most)
        activation = 2 if precision in ("bf16", "fp16") else 4
        per_token = 3 * width + layers * (8 * width + 2 * ffn)
        parts["activations"] = per_token * length * micro * activation
        return MemoryEstimate(parts)
    return None


def largest_node_memory(
    resources: Mapping[str, float], nodes: Iterable[Mapping[str, float]]
) -> float | None:
    """Bytes of Ray's ``memory`` resource on the biggest of ``nodes`` (each node's total
    resources) that could hold one worker asking for ``resources``; None when they report
    no memory."""
    best: float | None = None
    for node in nodes:
        if all(node.get(k, 0.0) >= v for k, v in resources.items()) and "memory" in node:
            best = max(best or 0.0, float(node["memory"]))
    return best
