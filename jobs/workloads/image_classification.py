"""The image-classification workload: a torchvision model on synthetic images or a folder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic.loop import TrainContext
from jobs.workloads.image_classification_params import ImageClassificationHyperparameters


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def build_model(hp: ImageClassificationHyperparameters) -> nn.Module:
    # The same seed on every rank: identical initial weights before DDP's broadcast.
    torch.manual_seed(hp.seed)
    if hp.model == "small_cnn":
        return SmallCNN(hp.num_classes)
    import torchvision

    return torchvision.models.get_model(hp.model, weights=None, num_classes=hp.num_classes)


class SyntheticImages(Dataset):
    """Seeded images that carry their class (a per-class pattern plus noise), so a model can
    learn them and a loss curve means something. Sample ``i`` is the same on every node."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int) -> None:
        self.size, self.num_classes, self.seed = size, num_classes, seed
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, 3, image_size, image_size, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        label = i % self.num_classes
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        noise = torch.randn(self.patterns.shape[1:], generator=g)
        return self.patterns[label] + noise, label


def build_dataset(hp: ImageClassificationHyperparameters) -> Dataset:
    if hp.dataset == "synthetic":
        return SyntheticImages(hp.synthetic_samples, hp.image_size, hp.num_classes, hp.seed)
    from torchvision import datasets, transforms

    assert hp.data_path is not None  # the spec guarantees it for imagefolder
    return datasets.ImageFolder(
        hp.data_path,
        transform=transforms.Compose([
            transforms.Resize(hp.image_size),
            transforms.CenterCrop(hp.image_size),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]),
    )


def train_loop(config: dict[str, Any], ctx: TrainContext) -> None:
    hp = ImageClassificationHyperparameters.model_validate(config["hyperparameters"])
    criterion = nn.CrossEntropyLoss(reduction="none")
    model = ctx.prepare_model(build_model(hp), dtype=getattr(torch, hp.dtype))
    ctx.prepare_optimizer(torch.optim.SGD(
        model.parameters(), lr=hp.learning_rate, momentum=hp.momentum,
        weight_decay=hp.weight_decay))
    for batch in ctx.batches(
        build_dataset(hp), hp.global_batch_size, epochs=hp.epochs, max_steps=hp.max_steps,
        seed=hp.seed, lr_schedule=hp.lr_schedule, warmup_steps=hp.warmup_steps,
        report_every_steps=hp.report_every_steps, record_samples=hp.record_samples,
    ):
        ctx.train_step(batch, criterion)
