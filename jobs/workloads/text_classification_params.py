"""Hyperparameters of the text-classification workload (no torch import here)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jobs.validation import field_error

VOCAB_SUFFIXES = (".txt", ".vocab")


class TextClassificationHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_path: str = Field(
        min_length=1,
        description="A .csv (with a header naming 'text' and 'label') or .jsonl file of "
        '{"text": ..., "label": ...}; it must be readable from every Ray node.',
    )
    eval_path: str | None = Field(
        None,
        min_length=1,
        description="Held-out file in the same format; without it, "
        "eval_fraction of data_path is held out.",
    )
    eval_fraction: float = Field(
        0.1,
        ge=0,
        le=0.5,
        description="Share of data_path held out for the evaluation run "
        "after each epoch (when no eval_path is given; 0: no evaluation).",
    )
    vocab_path: str | None = Field(
        None,
        min_length=1,
        description="A vocabulary file (.txt or .vocab), one token per line; without it, "
        "the vocabulary is built from the training texts.",
    )
    vocab_size: int = Field(20_000, ge=10, le=1_000_000, description="Most tokens kept.")
    min_token_count: int = Field(1, ge=1, le=1_000_000, description="Rarer tokens become [UNK].")
    max_length: int = Field(128, ge=2, le=8192, description="Tokens per text, with [CLS].")
    layers: int = Field(2, ge=1, le=48, description="Transformer encoder layers.")
    heads: int = Field(4, ge=1, le=64, description="Attention heads per layer.")
    width: int = Field(128, ge=8, le=8192, description="Model width (embedding size).")
    ffn_width: int | None = Field(
        None, ge=8, le=65_536, description="Feed-forward width; 4 x width when unset."
    )
    dropout: float = Field(0.1, ge=0, lt=1)
    epochs: int | None = Field(None, ge=1, le=100_000, description="Passes over the data.")
    max_steps: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="Optimizer steps; the run stops at the first of epochs and max_steps.",
    )
    global_batch_size: int = Field(
        32, ge=1, le=1_048_576, description="Samples per optimizer step, across all workers."
    )
    learning_rate: float = Field(5e-4, gt=0, le=100, description="AdamW's learning rate.")
    weight_decay: float = Field(0.01, ge=0, le=1)
    lr_schedule: Literal["constant", "cosine"] = Field("constant")
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    record_samples: bool = Field(False, description="Audit the sample indices per step.")
    report_every_steps: int = Field(1, ge=1, le=100_000)

    @model_validator(mode="after")
    def _check(self) -> TextClassificationHyperparameters:
        title = type(self).__name__
        if self.epochs is None and self.max_steps is None:
            raise field_error(
                title, "max_steps", "give epochs or max_steps (or both: the run stops at the first)"
            )
        if self.width % self.heads:
            raise field_error(
                title,
                "heads",
                f"width ({self.width}) must be a multiple of heads ({self.heads})",
                self.heads,
            )
        if not self.data_path.endswith((".csv", ".jsonl")):
            raise field_error(title, "data_path", "use a .csv or .jsonl file", self.data_path)
        if self.eval_path is not None and not self.eval_path.endswith((".csv", ".jsonl")):
            raise field_error(title, "eval_path", "use a .csv or .jsonl file", self.eval_path)
        if self.vocab_path is not None and not self.vocab_path.endswith(VOCAB_SUFFIXES):
            raise field_error(
                title,
                "vocab_path",
                f"use a {' or '.join(VOCAB_SUFFIXES)} file (one token per line)",
                self.vocab_path,
            )
        return self
