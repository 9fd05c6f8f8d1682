"""MNIST digits with a small convolutional network: main.py is the plain script, loop.py
its port to elastic-train's ctx, ray_train.py its port to Ray Train (examples/README.md).

Written for elastic-train in the style of pytorch/examples' ``mnist/main.py`` (not a copy
of it). The data are MNIST's idx files under ``--data``'s ``MNIST/raw/``; no download."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torchvision import datasets, transforms

from elastic.train import get_context


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, ctx, train_loader, optimizer, epoch):
    model.train()
    lr = optimizer.param_groups[0]["lr"]
    for batch_idx, batch in enumerate(train_loader):
        loss = ctx.train_step(
            batch, forward=lambda m: F.nll_loss(model(m.inputs), m.targets, reduction="none")
        )
        if batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * args.batch_size}/{args.train_size}]"
                f"\tlr: {lr:.6f}\tLoss: {loss:.6f}"
            )


def test(model, device, test_loader):
    model.eval()
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    size = len(test_loader.dataset)
    test_loss /= size
    print(
        f"Test set: Average loss: {test_loss:.4f}, "
        f"Accuracy: {correct}/{size} ({100.0 * correct / size:.0f}%)"
    )


def make_parser():
    parser = argparse.ArgumentParser(description="MNIST, a small conv net")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch size")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="testing batch size")
    parser.add_argument("--epochs", type=int, default=14, help="epochs to train")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma")
    parser.add_argument("--seed", type=int, default=1, help="random seed")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between logs")
    parser.add_argument("--save-model", action="store_true", help="save the trained model")
    parser.add_argument("--data", default="../data", help="the root holding MNIST/raw/")
    return parser


def main():
    args = make_parser().parse_args()
    ctx = get_context()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
    )
    dataset1 = datasets.MNIST(args.data, train=True, download=False, transform=transform)
    dataset2 = datasets.MNIST(args.data, train=False, download=False, transform=transform)
    args.train_size = len(dataset1)
    test_loader = torch.utils.data.DataLoader(dataset2, batch_size=args.test_batch_size)
    train_loader = torch.utils.data.DataLoader(dataset1, batch_size=args.batch_size, shuffle=True)
    train_loader = ctx.loader(train_loader, epochs=args.epochs, seed=args.seed)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    model, optimizer, scheduler = ctx.prepare(model, optimizer, scheduler)
    for epoch in range(ctx.position.epoch + 1, args.epochs + 1):  # resumes mid-way
        train(args, model, ctx, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model:
        torch.save(model.state_dict(), "mnist_cnn.pt")
    print(f"Done: {args.epochs} epochs")


if __name__ == "__main__":
    main()
