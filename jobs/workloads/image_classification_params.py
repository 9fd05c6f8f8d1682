"""Hyperparameters of the image-classification workload (no torch import here)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jobs.validation import field_error


class ImageClassificationHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Literal[
        "resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "efficientnet_b0", "small_cnn"
    ] = Field(
        "resnet18",
        description="A torchvision model by name (randomly initialised), or a "
        "small CNN for fast runs.",
    )
    dataset: Literal["synthetic", "imagefolder", "cifar10"] = Field(
        "synthetic",
        description="Seeded synthetic images; an ImageFolder directory; or "
        "CIFAR-10's python batches (data_batch_1..5, test_batch) in a directory.",
    )
    data_path: str | None = Field(
        None,
        min_length=1,
        description="Root of the ImageFolder tree (one sub-directory per class) or the "
        "CIFAR-10 directory (nothing is downloaded); it must be readable from every Ray node.",
    )
    eval_path: str | None = Field(
        None,
        min_length=1,
        description="imagefolder: a held-out ImageFolder tree with the "
        "same classes; without it, eval_fraction of data_path is held out.",
    )
    eval_fraction: float = Field(
        0.1,
        ge=0,
        le=0.5,
        description="imagefolder without eval_path: the seeded share of "
        "images held out for the evaluation after each epoch (0: none).",
    )
    synthetic_eval_samples: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="synthetic: held-out samples evaluated after each epoch (0: none).",
    )
    augment: Literal["none", "crop", "crop_flip"] | None = Field(
        None,
        description="Training transforms: random crop (padding of an eighth of the side), "
        "and horizontal flip; each sample's randomness is seeded by (seed, epoch, sample), "
        "so it is the same at any world size. Default: crop_flip for imagefolder and "
        "cifar10, none for synthetic.",
    )
    epochs: int | None = Field(None, ge=1, le=100_000, description="Passes over the data.")
    max_steps: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="Optimizer steps; the run stops at the first of epochs and max_steps.",
    )
    global_batch_size: int = Field(
        64, ge=1, le=1_048_576, description="Samples per optimizer step, across all workers."
    )
    learning_rate: float = Field(0.1, gt=0, le=100)
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="Indexed by optimizer step, so resizes leave it unchanged."
    )
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Linear warm-up steps.")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    image_size: int = Field(32, ge=8, le=1024, description="Side of the (square) input images.")
    num_classes: int = Field(10, ge=2, le=100_000)
    synthetic_samples: int = Field(
        2048, ge=1, le=10_000_000, description="Size of the synthetic dataset."
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="Parameter and input precision (float64 for exactness checks)."
    )
    record_samples: bool = Field(
        False,
        description="Write the sample indices each worker trains on, per step, beside the "
        "checkpoints (an audit that no sample is skipped or repeated).",
    )
    report_every_steps: int = Field(
        1, ge=1, le=100_000, description="How often rank 0 reports metrics."
    )

    @property
    def augmentation(self) -> str:
        """``augment`` with its default resolved for the dataset."""
        if self.augment is not None:
            return self.augment
        return "none" if self.dataset == "synthetic" else "crop_flip"

    @model_validator(mode="after")
    def _check(self) -> ImageClassificationHyperparameters:
        title = type(self).__name__
        if self.epochs is None and self.max_steps is None:
            raise field_error(
                title, "max_steps", "give epochs or max_steps (or both: the run stops at the first)"
            )
        if self.dataset in ("imagefolder", "cifar10") and not self.data_path:
            raise field_error(
                title, "data_path", f"data_path is required for dataset '{self.dataset}'"
            )
        if self.eval_path is not None and self.dataset != "imagefolder":
            raise field_error(
                title,
                "eval_path",
                "eval_path is for dataset 'imagefolder' (cifar10 evaluates on its test_batch)",
                self.eval_path,
            )
        return self
