"""scikit-learn's bundled 8x8 handwritten digits (1797 real images, shipped with the
package: nothing is downloaded) written out as ImageFolder trees."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_imagefolders(root: Path, held_out_every: int = 5) -> tuple[Path, Path]:
    """``root/train/<digit>/*.png`` and ``root/eval/<digit>/*.png``: every
    ``held_out_every``-th image is held out."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        part = "eval" if i % held_out_every == 0 else "train"
        folder = root / part / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * (255 / 16)).round().astype(np.uint8)  # values 0..16 -> 0..255
        Image.fromarray(pixels, mode="L").convert("RGB").save(folder / f"{i:04d}.png")
    return root / "train", root / "eval"
