"""A small ResNet on 32x32 images: main.py is the plain script, loop.py its port to
elastic-train's ctx, ray_train.py its port to Ray Train (examples/README.md).

Written for elastic-train in the style of the usual CIFAR-10 ResNet training scripts (not
a copy of any): random-crop and flip augmentation, a DataLoader with worker processes,
SGD with momentum, gradient clipping, an evaluation after each epoch. The images are
synthetic, drawn from ``--seed``: ten classes, each a fixed random pattern plus noise."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import SGD
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from elastic.train import get_context


class SyntheticImages(Dataset):
    def __init__(self, size, seed, split, transform=None):
        patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed * 1000 + split)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.images = patterns[self.labels] + 0.8 * torch.randn(size, 3, 32, 32, generator=g)
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[i]


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width=16, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.layers = nn.Sequential(
            BasicBlock(width, width, 1),
            BasicBlock(width, 2 * width, 2),
            BasicBlock(2 * width, 4 * width, 2),
        )
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def train_one_epoch(args, model, ctx, loader, optimizer, epoch):
    model.train()
    for i, batch in enumerate(loader):
        loss = ctx.train_step(
            batch,
            forward=lambda m: F.cross_entropy(model(m.inputs), m.targets, reduction="none"),
            before_step=lambda: nn.utils.clip_grad_norm_(model.parameters(), args.clip),
        )
        if i % args.print_freq == 0:
            print(f"epoch {epoch} step {i} loss {loss:.4f}")


def evaluate(model, device, loader, epoch):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            predicted = model(images.to(device)).argmax(dim=1)
            correct += (predicted == labels.to(device)).sum().item()
            total += len(labels)
    print(f"epoch {epoch} eval accuracy {correct / total:.4f} ({correct}/{total})")


def make_parser():
    parser = argparse.ArgumentParser(description="a small ResNet on synthetic images")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--test-size", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--print-freq", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main():
    args = make_parser().parse_args()
    ctx = get_context()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    augment = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])
    train_set = SyntheticImages(args.train_size, args.seed, split=0, transform=augment)
    test_set = SyntheticImages(args.test_size, args.seed, split=1)
    test_loader = DataLoader(test_set, batch_size=256, num_workers=args.workers)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, num_workers=args.workers)
    train_loader = ctx.loader(train_loader, epochs=args.epochs, seed=args.seed)

    model = ResNet(args.width).to(device)
    optimizer = SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = ctx.prepare(model, optimizer)
    for epoch in range(ctx.position.epoch, args.epochs):  # resumes mid-way
        train_one_epoch(args, model, ctx, train_loader, optimizer, epoch)
        evaluate(model, device, test_loader, epoch)
    print(f"Done: {args.epochs} epochs")


if __name__ == "__main__":
    main()
