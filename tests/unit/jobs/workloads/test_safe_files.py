"""Users' dataset files are read, never run: CIFAR-10's pickled batches through an unpickler
that builds only what the format holds, paths re-checked on the worker, and errors that
never quote a file."""

from __future__ import annotations

import io
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jobs.workloads.image_classification import Cifar10, build_datasets
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from jobs.workloads.safe_files import DataError, DatasetUnpickler, load_cifar10_batch
from jobs.workloads.text_classification import Tokenizer, read_examples

NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _short(text: bytes) -> bytes:
    return b"U" + bytes([len(text)]) + text  # SHORT_BINSTRING: a Python 2 str


def python2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A batch byte for byte as Python 2's cPickle wrote the official CIFAR-10 files
    (protocol 2, str keys, numpy.core's _reconstruct, the raw pixels as one str)."""
    out = bytearray(b"\x80\x02}q\x00(")
    out += _short(b"data")
    out += b"cnumpy.core.multiarray\n_reconstruct\nq\x01cnumpy\nndarray\nq\x02"
    out += b"K\x00\x85" + _short(b"b") + b"\x87R"
    out += b"(K\x01J" + struct.pack("<i", data.shape[0]) + b"M\x00\x0c\x86"
    out += b"cnumpy\ndtype\n" + _short(b"u1") + b"K\x00K\x01\x87R"
    out += b"(K\x03" + _short(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    raw = data.tobytes()
    out += b"\x89T" + struct.pack("<I", len(raw)) + raw + b"tb"
    out += _short(b"labels") + b"](" + b"".join(b"K" + bytes([y]) for y in labels) + b"e"
    return bytes(out + b"u.")


def official_batches(root: Path, per_batch: int, python2: bool = False) -> np.ndarray:
    rng = np.random.default_rng(0)
    first = np.zeros(0)
    for name in NAMES:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, per_batch)]
        if python2:
            (root / name).write_bytes(python2_batch(data, labels))
        else:
            batch = {b"batch_label": b"training batch", b"data": data, b"labels": labels}
            (root / name).write_bytes(pickle.dumps(batch, protocol=2))
        if name == "data_batch_1":
            first = data
    return first


@pytest.mark.parametrize("python2", [False, True], ids=["python3-protocol2", "python2-cpickle"])
def test_official_cifar10_batches_still_load(tmp_path: Path, python2: bool) -> None:
    first = official_batches(tmp_path, 4, python2)
    hp = ImageClassificationHyperparameters(
        dataset="cifar10", data_path=str(tmp_path), max_steps=1, augment="none"
    )
    train, held_out = build_datasets(hp)
    assert (len(train), len(held_out)) == (20, 4)  # type: ignore[arg-type]
    assert torch.equal(train.images[0], torch.from_numpy(first[0]).reshape(3, 32, 32))  # type: ignore[attr-defined]


class RunsCode:
    """What an attacker pickles: unpickling it calls exec with their source."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.source,))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    official_batches(tmp_path, 2)
    payload = {b"data": RunsCode(f"open({str(marker)!r}, 'w').write('x')"), b"labels": [0]}
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(DataError, match="data_batch_1 is not a CIFAR-10 python batch"):
        Cifar10(str(tmp_path), True, lambda x: x)
    assert not marker.exists()


def _unpickle(data: bytes) -> Any:
    return DatasetUnpickler(io.BytesIO(data), encoding="bytes").load()


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(os.getcwd, protocol=2),  # any global
        b"\x80\x02cnumpy\nload\nq\x00.",  # a numpy function that reads files
        b"\x80\x02cnumpy\nndarray\n(J\x00\x00\x00\x7f\x85tR.",  # the constructor, huge shape
        b"\x80\x02cnumpy._core.multiarray\n_reconstruct\ncbuiltins\nobject\nK\x00\x85U\x01b\x87R.",
        b"\x80\x02cnumpy\ndtype\nU\x01OK\x00K\x01\x87R.",  # an object array's dtype
        b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x04\x00\x00\x00zlib\x86R.",
        b"\x80\x02X\x01\x00\x00\x00aQ.",  # a persistent id
    ],
    ids=[
        "global",
        "numpy.load",
        "ndarray-new",
        "reconstruct-other",
        "object-dtype",
        "codec",
        "pid",
    ],
)
def test_the_unpickler_builds_nothing_but_plain_data(payload: bytes) -> None:
    with pytest.raises(pickle.UnpicklingError):
        _unpickle(payload)


@pytest.mark.parametrize(
    "batch",
    [
        {b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]},
        {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]},
        {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]},
        {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]},
        [1, 2, 3],
    ],
    ids=["float", "width", "count", "label-range", "not-a-dict"],
)
def test_a_batch_of_the_wrong_shape_is_refused(tmp_path: Path, batch: Any) -> None:
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match="not a CIFAR-10 python batch"):
        load_cifar10_batch(tmp_path / "data_batch_1")


def test_a_path_that_moved_after_submission_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    official_batches(real, 2)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(DataError, match="resolves somewhere else"):
        Cifar10(str(link), True, lambda x: x)
    with pytest.raises(DataError, match="not an absolute path"):
        Cifar10("real", True, lambda x: x)


def test_an_image_tree_reads_no_file_through_a_link_out_of_it(tmp_path: Path) -> None:
    from PIL import Image

    tree = tmp_path / "tree"
    for cls in ("cat", "dog"):
        (tree / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tree / cls / "own.png")
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    Image.new("RGB", (8, 8)).save(secret / "theirs.png")
    (tree / "cat" / "linked.png").symlink_to(secret / "theirs.png")
    (tree / "theirs").symlink_to(secret)  # a class directory that is a link out
    hp = ImageClassificationHyperparameters(
        dataset="imagefolder", data_path=str(tree), max_steps=1, eval_fraction=0, image_size=8
    )
    train, _ = build_datasets(hp)
    assert sorted(Path(p).relative_to(tree).as_posix() for p, _ in train.samples) == [  # type: ignore[attr-defined]
        "cat/own.png",
        "dog/own.png",
    ]


def test_errors_name_the_problem_not_the_contents(tmp_path: Path) -> None:
    secret = "alice-private-label-9f2c"
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi", "label": "a"}\n{' + secret + "\n")
    with pytest.raises(DataError) as err:
        read_examples(str(data))
    assert secret not in str(err.value) and "d.jsonl is not valid JSON lines" in str(err.value)

    binary = tmp_path / "etrain.txt"
    binary.write_bytes(b"SQLite format 3\x00\xff\xfe" + secret.encode())
    with pytest.raises(DataError, match="not UTF-8 text") as err2:
        Tokenizer.from_file(str(binary))
    assert secret not in str(err2.value)

    tree = tmp_path / "checkpoints"
    for job in ("job-0001", "job-0002"):
        (tree / job).mkdir(parents=True)  # class directories with no images in them
    hp = ImageClassificationHyperparameters(
        dataset="imagefolder", data_path=str(tree), max_steps=1, eval_fraction=0
    )
    with pytest.raises(DataError) as err3:
        build_datasets(hp)
    assert "job-0001" not in str(err3.value) and "is not an image tree" in str(err3.value)
