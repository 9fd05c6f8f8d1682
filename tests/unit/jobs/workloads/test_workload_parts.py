"""The workloads' parts, each on its own: tokenizer, text files, the encoder, CIFAR-10's
batch format, the image transforms, the models by name, and the hyperparameter checks."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from elastic.train.context import PerSampleRandom
from jobs.workloads.image_classification import Cifar10, build_datasets, build_model
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from jobs.workloads.text_classification import (
    Tokenizer,
    build_data,
    read_examples,
)
from jobs.workloads.text_classification import (
    build_model as build_text_model,
)
from jobs.workloads.text_classification_params import TextClassificationHyperparameters


def test_the_tokenizer_ranks_by_count_then_name_and_pads() -> None:
    tok = Tokenizer.from_texts(["b a, a!", "c b a"], size=10)
    assert tok.vocab == ["[PAD]", "[UNK]", "[CLS]", "a", "b", "!", ",", "c"]
    assert tok.encode("A b zebra", 6) == [2, 3, 4, 1, 0, 0]
    assert tok.encode("a a a a a a", 3) == [2, 3, 3]
    assert Tokenizer.from_texts(["b a a"], size=4).vocab == ["[PAD]", "[UNK]", "[CLS]", "a"]


def test_a_vocab_file_and_held_out_split(tmp_path: Path) -> None:
    (tmp_path / "vocab.txt").write_text("good\nbad\n")
    (tmp_path / "d.csv").write_text(
        "text,label\n" + "".join(f"{'good' if i % 2 else 'bad'} day,{i % 2}\n" for i in range(20))
    )
    hp = TextClassificationHyperparameters(
        data_path=str(tmp_path / "d.csv"),
        max_steps=1,
        vocab_path=str(tmp_path / "vocab.txt"),
        eval_fraction=0.25,
        max_length=4,
    )
    train, held_out, tok, labels = build_data(hp)
    assert tok.vocab == ["[PAD]", "[UNK]", "[CLS]", "good", "bad"]
    assert labels == {"0": 0, "1": 1}
    assert (len(train), len(held_out)) == (15, 5)  # type: ignore[arg-type]
    ids, label = train[0]
    assert ids.tolist() == [2, 4, 1, 0] and int(label) == 0
    model = build_text_model(hp, len(tok.vocab), 2)
    assert model(torch.stack([train[i][0] for i in range(3)])).shape == (3, 2)


def test_a_text_file_without_its_columns_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("sentence,label\nhi,1\n")
    with pytest.raises(ValueError, match="record 1 lacks 'text' or 'label'"):
        read_examples(str(tmp_path / "d.csv"))


@pytest.mark.parametrize(
    "fields,field,message",
    [
        ({"width": 30, "heads": 4}, "heads", "width (30) must be a multiple of heads (4)"),
        ({"data_path": "d.txt"}, "data_path", "use a .csv or .jsonl file"),
        ({"max_steps": None}, "max_steps", "give epochs or max_steps"),
    ],
)
def test_text_hyperparameters_name_the_bad_field(fields: dict, field: str, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        TextClassificationHyperparameters(**{"data_path": "d.csv", "max_steps": 5, **fields})
    (e,) = err.value.errors()
    assert e["loc"] == (field,) and message in e["msg"]


def write_cifar(root: Path, per_batch: int) -> None:
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(x) for x in rng.integers(0, 10, per_batch)],
        }
        (root / name).write_bytes(pickle.dumps(batch))


def test_cifar10_batches_are_read_from_a_directory(tmp_path: Path) -> None:
    write_cifar(tmp_path, 4)
    hp = ImageClassificationHyperparameters(
        dataset="cifar10", data_path=str(tmp_path), max_steps=1, image_size=32
    )
    train, held_out = build_datasets(hp)
    assert (len(train), len(held_out)) == (20, 4)  # type: ignore[arg-type]
    image, label = train[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 10
    # The held-out images are not augmented: the same tensor every time.
    assert torch.equal(held_out[0][0], held_out[0][0])  # type: ignore[index]
    with pytest.raises(FileNotFoundError, match="not a CIFAR-10 python batch"):
        Cifar10(str(tmp_path / "missing"), True, lambda x: x)


@pytest.mark.parametrize("name", ["resnet34", "mobilenet_v3_small", "efficientnet_b0"])
def test_models_by_name_classify_into_num_classes(name: str) -> None:
    hp = ImageClassificationHyperparameters(model=name, max_steps=1, num_classes=7)
    model = build_model(hp).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def test_synthetic_held_out_samples_are_new_ones() -> None:
    hp = ImageClassificationHyperparameters(
        dataset="synthetic", synthetic_samples=10, synthetic_eval_samples=5, max_steps=1
    )
    train, held_out = build_datasets(hp)
    assert held_out is not None and len(held_out) == 5  # type: ignore[arg-type]
    assert not torch.equal(train[0][0], held_out[0][0])
    assert held_out[0][1] == 10 % hp.num_classes


def test_augmentations_are_seeded_per_sample_and_epoch() -> None:
    hp = ImageClassificationHyperparameters(
        dataset="synthetic", augment="crop_flip", image_size=8, synthetic_samples=32, max_steps=1
    )
    train, _ = build_datasets(hp)
    assert isinstance(train, PerSampleRandom)
    first = [train[i][0] for i in range(32)]
    torch.manual_seed(12345)  # whatever a rank's own generator holds
    again = [train[i][0] for i in reversed(range(32))][::-1]  # another order, another rank
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    train.set_epoch(1)
    assert sum(not torch.equal(a, train[i][0]) for i, a in enumerate(first)) >= 16
    # Unseeded, the same transform draws anew at every read.
    raw = train.dataset
    assert any(not torch.equal(raw[i][0], raw[i][0]) for i in range(32))


def test_synthetic_images_are_not_augmented_unless_asked() -> None:
    hp = ImageClassificationHyperparameters(dataset="synthetic", max_steps=1)
    assert hp.augmentation == "none"
    train, _ = build_datasets(hp)
    assert not isinstance(train, PerSampleRandom)
    cifar = ImageClassificationHyperparameters(dataset="cifar10", data_path="/x", max_steps=1)
    assert cifar.augmentation == "crop_flip"


def test_the_readme_job_builds_its_data_and_model_without_torchvision() -> None:
    """Importing torchvision is a second of every new worker's start: the synthetic job of
    the README, which augments nothing, builds without it (in a fresh interpreter, as a
    worker does)."""
    code = (
        "import json, sys\n"
        "from jobs.workloads.image_classification import build_datasets, build_model\n"
        "from jobs.workloads.image_classification_params import "
        "ImageClassificationHyperparameters as H\n"
        "hp = H.model_validate(json.load(open('examples/job.json'))['hyperparameters'])\n"
        "train, _ = build_datasets(hp)\n"
        "build_model(hp)(train[0][0][None])\n"
        "print('torchvision' in sys.modules)\n"
    )
    root = Path(__file__).parents[4]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"
