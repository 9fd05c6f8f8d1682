"""The loop's data, a module of its own package (imported as the package's, not installed)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def table(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.sin(x[:, 0]) + x[:, 1] * x[:, 2]
    return TensorDataset(x, y.unsqueeze(1))
