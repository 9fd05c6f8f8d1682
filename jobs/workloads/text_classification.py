"""The text-classification workload: a BERT-style encoder built from torch's
``nn.TransformerEncoder`` (learned positions, [CLS] pooling) over a word-level tokenizer
built from the training texts or read from a vocabulary file."""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from elastic.train.context import TrainContext
from jobs.workloads.safe_files import DataError, admin_detail, checked_path, must_exist, read_text
from jobs.workloads.text_classification_params import TextClassificationHyperparameters

PAD, UNK, CLS = "[PAD]", "[UNK]", "[CLS]"
SPECIALS = [PAD, UNK, CLS]
_TOKEN = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class Tokenizer:
    """Lower-cased words and punctuation; ids 0-2 are [PAD], [UNK], [CLS]."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = SPECIALS + [t for t in vocab if t not in SPECIALS]
        self.ids = {t: i for i, t in enumerate(self.vocab)}

    @classmethod
    def from_texts(cls, texts: Iterable[str], size: int, min_count: int = 1) -> Tokenizer:
        counts = Counter(w for t in texts for w in words(t))
        # By count, then alphabetically: the same vocabulary on every worker.
        ranked = sorted(
            (w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w)
        )
        return cls(ranked[: size - len(SPECIALS)])

    @classmethod
    def from_file(cls, path: str, field: str = "vocab_path") -> Tokenizer:
        lines = read_text(checked_path(path, field), field).splitlines()
        return cls([ln.strip() for ln in lines if ln.strip()])

    def encode(self, text: str, max_length: int) -> list[int]:
        unk = self.ids[UNK]
        ids = [self.ids[CLS]] + [self.ids.get(w, unk) for w in words(text)]
        ids = ids[:max_length]
        return ids + [self.ids[PAD]] * (max_length - len(ids))


def read_examples(path: str, field: str = "data_path") -> list[tuple[str, str]]:
    """(text, label) pairs from a .csv with 'text' and 'label' columns or a .jsonl file.
    Errors name the record, never quote it."""
    p = checked_path(path, field)
    must_exist(p, field, "file")
    text = read_text(p, field)
    try:
        if p.suffix == ".jsonl":
            rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
        else:
            rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except (ValueError, csv.Error) as e:
        admin_detail(f"{path}: {type(e).__name__}: {e}")
        kind = "JSON lines" if p.suffix == ".jsonl" else "CSV"
        raise DataError(f"{field}: {p.name} is not valid {kind}") from None
    out = []
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or "text" not in row or "label" not in row:
            raise DataError(f"{field}: {p.name}: record {n} lacks 'text' or 'label'")
        out.append((str(row["text"]), str(row["label"])))
    if not out:
        raise DataError(f"{field}: {p.name} holds no examples")
    return out


class EncodedTexts(Dataset[Any]):
    def __init__(
        self,
        examples: list[tuple[str, str]],
        tokenizer: Tokenizer,
        labels: dict[str, int],
        max_length: int,
    ) -> None:
        unknown = {y for _, y in examples} - labels.keys()
        if unknown:
            raise DataError(f"eval_path: {len(unknown)} of its labels are not in the training data")
        self.ids = torch.tensor([tokenizer.encode(t, max_length) for t, _ in examples])
        self.labels = torch.tensor([labels[y] for _, y in examples])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.labels[i]


class TextEncoderClassifier(nn.Module):
    """Token and learned position embeddings, a pre-norm transformer encoder, and a linear
    head on the [CLS] position."""

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        max_length: int,
        width: int,
        heads: int,
        layers: int,
        ffn_width: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width, padding_idx=0)
        self.positions = nn.Embedding(max_length, width)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            width, heads, ffn_width, dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.tokens(ids) + self.positions(positions))
        x = self.encoder(x, src_key_padding_mask=ids == 0)
        logits: torch.Tensor = self.head(self.norm(x[:, 0]))
        return logits


def build_data(
    hp: TextClassificationHyperparameters,
) -> tuple[Dataset[Any], Dataset[Any] | None, Tokenizer, dict[str, int]]:
    """The training and held-out sets, the tokenizer and the label ids, the same on every
    worker (nothing random but the seeded split)."""
    examples = read_examples(hp.data_path)
    labels = {y: i for i, y in enumerate(sorted({y for _, y in examples}))}
    if len(labels) < 2:
        raise DataError("data_path: needs at least 2 distinct labels")
    held_out: list[int] = []
    if hp.eval_path is None and hp.eval_fraction > 0:
        order = np.random.default_rng(hp.seed).permutation(len(examples))
        held_out = sorted(int(i) for i in order[: int(len(examples) * hp.eval_fraction)])
    train_idx = sorted(set(range(len(examples))) - set(held_out))
    tokenizer = (
        Tokenizer.from_file(hp.vocab_path)
        if hp.vocab_path
        else Tokenizer.from_texts(
            (examples[i][0] for i in train_idx), hp.vocab_size, hp.min_token_count
        )
    )
    everything = EncodedTexts(examples, tokenizer, labels, hp.max_length)
    train: Dataset[Any] = Subset(everything, train_idx)
    evaluation: Dataset[Any] | None = Subset(everything, held_out) if held_out else None
    if hp.eval_path is not None:
        evaluation = EncodedTexts(
            read_examples(hp.eval_path, "eval_path"), tokenizer, labels, hp.max_length
        )
    return train, evaluation, tokenizer, labels


def build_model(
    hp: TextClassificationHyperparameters, vocab_size: int, num_classes: int
) -> TextEncoderClassifier:
    torch.manual_seed(hp.seed)  # identical initial weights on every rank
    return TextEncoderClassifier(
        vocab_size,
        num_classes,
        hp.max_length,
        hp.width,
        hp.heads,
        hp.layers,
        hp.ffn_width or 4 * hp.width,
        hp.dropout,
    )


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hp = TextClassificationHyperparameters.model_validate(config["hyperparameters"])
    train, evaluation, tokenizer, labels = build_data(hp)
    criterion = nn.CrossEntropyLoss(reduction="none")
    model = ctx.prepare_model(build_model(hp, len(tokenizer.vocab), len(labels)))
    ctx.prepare_optimizer(
        torch.optim.AdamW(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    )
    for batch in ctx.batches(
        train,
        hp.global_batch_size,
        epochs=hp.epochs,
        max_steps=hp.max_steps,
        seed=hp.seed,
        lr_schedule=hp.lr_schedule,
        warmup_steps=hp.warmup_steps,
        report_every_steps=hp.report_every_steps,
        record_samples=hp.record_samples,
    ):
        ctx.train_step(batch, criterion)
        if batch.ends_epoch and evaluation is not None:
            ctx.evaluate(evaluation, loss_per_sample=criterion)
