"""The job every side of ``bench.recovery`` trains: its data, with each sample's index so
the summary can count which samples went into the model. Imports neither Ray nor torchrun:
every side's workers load it."""

from __future__ import annotations

from typing import Any

DATASET_SIZE = 100_000


def indexed_images() -> Any:
    """The seeded synthetic 32x32 images (10 classes), each item ``(image, label, index)``."""
    from torch.utils.data import Dataset

    from jobs.workloads.image_classification import SyntheticImages

    class IndexedImages(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.images = SyntheticImages(DATASET_SIZE, 32, 10, 0)

        def __len__(self) -> int:
            return len(self.images)

        def __getitem__(self, i: int) -> tuple[Any, int, int]:
            image, label = self.images[i]
            return image, label, i

    return IndexedImages()
