"""The image-classification workload: a torchvision model (or a small CNN) on synthetic
images, an ImageFolder tree or CIFAR-10, with a held-out evaluation after each epoch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from elastic.train.context import PerSampleRandom, TrainContext
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters
from jobs.workloads.safe_files import (
    DataError,
    checked_path,
    image_folder,
    inside,
    load_cifar10_batch,
)


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(x).flatten(1))
        return logits


def build_model(hp: ImageClassificationHyperparameters) -> nn.Module:
    # The same seed on every rank: identical initial weights before DDP's broadcast.
    torch.manual_seed(hp.seed)
    if hp.model == "small_cnn":
        return SmallCNN(hp.num_classes)
    import torchvision

    model: nn.Module = torchvision.models.get_model(
        hp.model, weights=None, num_classes=hp.num_classes
    )
    return model


class SyntheticImages(Dataset[Any]):
    """Seeded images that carry their class (a per-class pattern plus noise), so a model can
    learn them and a loss curve means something. Sample ``i`` is the same on every node."""

    def __init__(
        self,
        size: int,
        image_size: int,
        num_classes: int,
        seed: int,
        first: int = 0,
        transform: Any = None,
    ) -> None:
        # ``first``: where a held-out set starts, past the training samples' noise.
        self.size, self.num_classes, self.seed, self.first = size, num_classes, seed, first
        self.transform = transform
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, 3, image_size, image_size, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        i += self.first
        label = i % self.num_classes
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        noise = torch.randn(self.patterns.shape[1:], generator=g)
        image = self.patterns[label] + noise
        return (self.transform(image) if self.transform else image), label


IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def image_transforms(
    hp: ImageClassificationHyperparameters,
    train: bool,
    stats: tuple[tuple[float, ...], tuple[float, ...]],
) -> Any:
    """PIL image or uint8 CHW tensor -> normalised float tensor of ``image_size``. Training
    adds the augmentations ``augment`` names (seeded per sample: see ``build_datasets``)."""
    from torchvision.transforms import v2

    size = hp.image_size
    steps: list[Any] = [v2.ToImage(), v2.Resize(size, antialias=True), v2.CenterCrop(size)]
    if train:
        steps += augmentations(hp)
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(*stats)]
    return v2.Compose(steps)


def augmentations(hp: ImageClassificationHyperparameters) -> list[Any]:
    if hp.augmentation == "none":
        return []
    from torchvision.transforms import v2

    size = hp.image_size
    steps: list[Any] = [v2.RandomCrop(size, padding=max(1, size // 8), padding_mode="reflect")]
    if hp.augmentation == "crop_flip":
        steps.append(v2.RandomHorizontalFlip())
    return steps


class Cifar10(Dataset[Any]):
    """CIFAR-10's python batches (``data_batch_1``..``5``, ``test_batch``) from a directory;
    nothing is downloaded."""

    def __init__(self, root: str, train: bool, transform: Any) -> None:
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        directory = checked_path(root, "data_path")
        images, labels = [], []
        for name in names:
            path = directory / name
            if not path.is_file() or not inside(directory, path):
                raise FileNotFoundError(
                    f"{path}: not a CIFAR-10 python batch (expected "
                    "data_batch_1..5 and test_batch in data_path)"
                )
            data, batch_labels = load_cifar10_batch(path)  # never the standard unpickler
            images.append(torch.from_numpy(data).reshape(-1, 3, 32, 32))
            labels += batch_labels
        self.images = torch.cat(images)
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[i]), self.labels[i]


def build_datasets(
    hp: ImageClassificationHyperparameters,
) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """The training set and the held-out set evaluated after each epoch (None: no
    evaluation). With augmentations, each training sample draws them from its own
    generator, seeded by (seed, epoch, index): the same at every world size."""
    train, held_out = _datasets(hp)
    if hp.augmentation != "none":
        train = PerSampleRandom(train, hp.seed)
    return train, held_out


def _compose(steps: list[Any]) -> Any:
    from torchvision.transforms import v2

    return v2.Compose(steps)


def _datasets(hp: ImageClassificationHyperparameters) -> tuple[Dataset[Any], Dataset[Any] | None]:
    if hp.dataset == "synthetic":
        # Without augmentations nothing of torchvision is needed: its import is a second
        # of each new worker's start, before its first step.
        steps = augmentations(hp)
        train = SyntheticImages(
            hp.synthetic_samples,
            hp.image_size,
            hp.num_classes,
            hp.seed,
            transform=_compose(steps) if steps else None,
        )
        held_out = SyntheticImages(
            hp.synthetic_eval_samples,
            hp.image_size,
            hp.num_classes,
            hp.seed,
            first=hp.synthetic_samples,
        )
        return train, held_out if hp.synthetic_eval_samples else None
    assert hp.data_path is not None  # the spec guarantees it
    if hp.dataset == "cifar10":
        return (
            Cifar10(hp.data_path, True, image_transforms(hp, True, CIFAR10_STATS)),
            Cifar10(hp.data_path, False, image_transforms(hp, False, CIFAR10_STATS)),
        )
    train_tree = image_folder(
        checked_path(hp.data_path, "data_path"),
        "data_path",
        image_transforms(hp, True, IMAGENET_STATS),
    )
    if hp.eval_path is not None:
        eval_tree = image_folder(
            checked_path(hp.eval_path, "eval_path"),
            "eval_path",
            image_transforms(hp, False, IMAGENET_STATS),
        )
        if eval_tree.classes != train_tree.classes:
            raise DataError(
                f"eval_path: its {len(eval_tree.classes)} classes are not the "
                f"{len(train_tree.classes)} classes of data_path (sub-directory names differ)"
            )
        return train_tree, eval_tree
    if hp.eval_fraction == 0:
        return train_tree, None
    eval_tree = image_folder(
        checked_path(hp.data_path, "data_path"),
        "data_path",
        image_transforms(hp, False, IMAGENET_STATS),
    )
    order = np.random.default_rng(hp.seed).permutation(len(train_tree))
    cut = int(len(order) * hp.eval_fraction)
    return (
        Subset(train_tree, sorted(int(i) for i in order[cut:])),
        Subset(eval_tree, sorted(int(i) for i in order[:cut])),
    )


def build_dataset(hp: ImageClassificationHyperparameters) -> Dataset[Any]:
    return build_datasets(hp)[0]


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hp = ImageClassificationHyperparameters.model_validate(config["hyperparameters"])
    train, held_out = build_datasets(hp)
    criterion = nn.CrossEntropyLoss(reduction="none")
    model = ctx.prepare_model(build_model(hp), dtype=getattr(torch, hp.dtype))
    ctx.prepare_optimizer(
        torch.optim.SGD(
            model.parameters(),
            lr=hp.learning_rate,
            momentum=hp.momentum,
            weight_decay=hp.weight_decay,
        )
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
        if batch.ends_epoch and held_out is not None:
            ctx.evaluate(held_out, loss_per_sample=criterion)
