"""Writes a small synthetic MNIST in the idx format that torchvision's ``MNIST`` reads
(``<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``): each digit a bright
bar at its own place, plus noise. For trying the example without the real data:
``python fake_mnist.py DIR --train 320 --test 64``."""

import argparse
import struct
from pathlib import Path

import torch


def write_fake_mnist(root, train=320, test=64, seed=0):
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = torch.randint(0, 10, (n,), generator=g)
        images = torch.randint(0, 60, (n, 28, 28), generator=g)
        for i, label in enumerate(labels.tolist()):
            images[i, 2 + 2 * label : 5 + 2 * label, 4:24] = 255
        with open(raw / f"{prefix}-images-idx3-ubyte", "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28))
            f.write(images.to(torch.uint8).numpy().tobytes())
        with open(raw / f"{prefix}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 0x801, n))
            f.write(labels.to(torch.uint8).numpy().tobytes())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a small synthetic MNIST")
    parser.add_argument("root")
    parser.add_argument("--train", type=int, default=320)
    parser.add_argument("--test", type=int, default=64)
    a = parser.parse_args()
    write_fake_mnist(a.root, a.train, a.test)
