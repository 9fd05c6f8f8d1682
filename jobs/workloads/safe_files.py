"""Reading users' dataset files without trusting them.

Nothing a user supplies is ever unpickled with the standard unpickler (which runs whatever
code the file names): CIFAR-10's python batches go through an unpickler that builds only
the plain types and uint8 arrays that format holds. Paths are re-checked on the worker
against the canonical form the service authorized at submission, so a symlink swapped in
afterwards is refused, and every file read under a dataset directory must resolve inside
it. Errors a user sees say what went wrong without quoting the file; the details go to the
worker process's own stderr (Ray's log files, which an admin reads), not to the job's log.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


class DataError(ValueError):
    """A dataset file is unreadable or malformed. Its message is safe to show the user: it
    names the field and the problem, never the file's contents."""


def admin_detail(message: str) -> None:
    """Record details for the admin: the worker's original stderr is Ray's log file, which
    the job's log (what the user reads) does not forward."""
    stream = sys.__stderr__
    if stream is not None:
        print(f"[elastic-train data] {message}", file=stream, flush=True)


# -- paths --------------------------------------------------------------------------------


def checked_path(path: str, field: str) -> Path:
    """``path`` as the service authorized it: absolute and canonical (its real path is
    itself). A path that resolves elsewhere now was changed after submission."""
    if "\x00" in path or not os.path.isabs(path):
        raise DataError(f"{field}: not an absolute path")
    if os.path.realpath(path) != os.path.normpath(path):
        admin_detail(f"{field} {path!r} now resolves to {os.path.realpath(path)!r}")
        raise DataError(
            f"{field}: {path} now resolves somewhere else than when the job was submitted "
            "(a symbolic link was changed); resubmit the job"
        )
    return Path(path)


def inside(root: Path, candidate: str | Path) -> bool:
    """Whether ``candidate`` resolves inside ``root`` (itself resolved)."""
    real = os.path.realpath(candidate)
    base = os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def must_exist(path: Path, field: str, kind: str) -> None:
    exists = path.is_dir() if kind == "directory" else path.is_file()
    if not exists:
        raise FileNotFoundError(f"{field}: {path} is not a {kind} (or is not readable)")


# -- CIFAR-10's python batches ------------------------------------------------------------

CIFAR_PIXELS = 3 * 32 * 32
CIFAR_CLASSES = 10
# The dtypes a numeric array may be rebuilt with; anything else (objects, records) is refused.
_PLAIN_DTYPES = {"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8", "b1"}


class _ArrayClass:
    """Stands in for ``numpy.ndarray`` in a pickle: only ``_reconstruct`` may use it, so a
    pickle cannot call the array constructor with a shape of its choosing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _ArrayClass:
        raise pickle.UnpicklingError("arrays are rebuilt only the way numpy pickles them")


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> np.ndarray:
    # numpy pickles every array as _reconstruct(ndarray, (0,), b"b") followed by its state.
    if subtype is not _ArrayClass or tuple(shape) != (0,) or dtype_code not in (b"b", "b"):
        raise pickle.UnpicklingError("an array that numpy did not write")
    return np.ndarray((0,), dtype="b")  # its state (shape, dtype, bytes) comes next


def _dtype(code: Any, align: Any = False, copy: Any = True) -> np.dtype:
    text = code.decode("ascii", "replace") if isinstance(code, bytes) else code
    # Python 2's numpy wrote the flags as 0/1, Python 3's as False/True.
    if text not in _PLAIN_DTYPES or align not in (0, 1) or copy not in (0, 1):
        raise pickle.UnpicklingError("an array of a type a dataset does not hold")
    return np.dtype(text)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # How Python 3 writes bytes at pickle protocol 2: latin-1 text, encoded back.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("an encoding a dataset does not use")
    return text.encode("latin-1")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # written by numpy 1.x
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,  # written by numpy 2.x
    ("numpy", "ndarray"): _ArrayClass,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _codecs_encode,
}


class DatasetUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, bytes, numbers and plain numeric numpy arrays;
    any other global a pickle names is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of a dataset")


def load_cifar10_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    """One CIFAR-10 python batch: (uint8 images N x 3072, N labels in 0..9)."""
    try:
        with path.open("rb") as f:
            batch = DatasetUnpickler(f, encoding="bytes").load()
    except Exception as e:  # any way a file can fail to parse; none of it reaches the user
        admin_detail(f"{path}: {type(e).__name__}: {e}")
        raise DataError(
            f"data_path: {path.name} is not a CIFAR-10 python batch (it holds something "
            "other than a dict of a uint8 array and labels)"
        ) from None
    data = batch.get(b"data", batch.get("data")) if isinstance(batch, dict) else None
    labels = batch.get(b"labels", batch.get("labels")) if isinstance(batch, dict) else None
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != CIFAR_PIXELS
        or not isinstance(labels, list)
        or len(labels) != data.shape[0]
        or not all(type(y) is int and 0 <= y < CIFAR_CLASSES for y in labels)
    ):
        raise DataError(
            f"data_path: {path.name} is not a CIFAR-10 python batch (expected b'data', a "
            f"uint8 array of N x {CIFAR_PIXELS}, and b'labels', N integers in 0..9)"
        )
    return data, labels


# -- text files -------------------------------------------------------------------------


def read_text(path: Path, field: str, max_bytes: int = 4 << 30) -> str:
    """A UTF-8 text file, whole."""
    try:
        if path.stat().st_size > max_bytes:
            raise DataError(f"{field}: {path.name} is larger than {max_bytes} bytes")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        admin_detail(f"{path}: {e}")
        raise DataError(f"{field}: {path.name} is not UTF-8 text") from None


# -- image trees ------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def image_folder(root: Path, field: str, transform: Any) -> Any:
    """torchvision's ImageFolder over ``root``, reading only image files whose real path is
    inside ``root`` (a symbolic link out of the tree is skipped), with errors that do not
    list the tree."""
    from torchvision import datasets

    must_exist(root, field, "directory")

    def is_valid(path: str) -> bool:
        return path.lower().endswith(IMAGE_EXTENSIONS) and inside(root, path)

    class Tree(datasets.ImageFolder):  # type: ignore[misc]  # torchvision ships no hints
        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            # Class directories inside the tree only: a link out of it is no class.
            names = sorted(
                e.name for e in os.scandir(directory) if e.is_dir() and inside(root, e.path)
            )
            if not names:
                raise FileNotFoundError("no class directories")
            return names, {name: i for i, name in enumerate(names)}

    try:
        return Tree(
            str(root), transform=transform, is_valid_file=is_valid, loader=_image_loader(field)
        )
    except (FileNotFoundError, OSError, ValueError) as e:
        admin_detail(f"{field} {root}: {type(e).__name__}: {e}")
        raise DataError(
            f"{field}: {root} is not an image tree (one sub-directory per class, each "
            f"holding images: {', '.join(IMAGE_EXTENSIONS)})"
        ) from None


def _image_loader(field: str) -> Callable[[str], Any]:
    def load(path: str) -> Any:
        from PIL import Image

        try:
            with open(path, "rb") as f:
                return Image.open(f).convert("RGB")
        except Exception as e:
            admin_detail(f"{path}: {type(e).__name__}: {e}")
            raise DataError(f"{field}: {os.path.basename(path)} is not a readable image") from None

    return load
