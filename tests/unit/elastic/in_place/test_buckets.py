"""Gradient buckets of an in-place replica (elastic/in_place/buckets.py): a real model's
real backward pass, the all-reduce recorded instead of sent (a world of one)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from elastic.in_place.buckets import GradientBuckets, plan_buckets

F32, F64 = torch.float32, torch.float64


def test_buckets_take_the_parameters_in_reverse_split_by_size_and_dtype() -> None:
    sizes = [(F32, 100), (F32, 100), (F64, 10), (F32, 200), (F32, 200), (F32, 300)]
    # 4 bytes a float32 element: the first bucket is full from 400 bytes, the others from 1000.
    assert plan_buckets(sizes, first_bytes=400, bytes_per_bucket=1000) == [
        [5],  # 1200 bytes: full at once
        [4, 3],  # 800 bytes, then 1600
        [2],  # another dtype
        [1, 0],  # 800 bytes: the last
    ]
    assert plan_buckets([]) == []


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Registered first: its bucket is the last (buckets go in reverse). An unused
        # parameter holds back the buckets after it until the backward pass ends.
        self.unused = nn.Linear(3, 3)
        self.a = nn.Linear(8, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Recorder:
    """Records every launch: which bucket, what it held then, and whether the backward
    pass was still running."""

    def __init__(self, buckets: GradientBuckets) -> None:
        self.buckets = buckets
        self.launched: list[tuple[int, torch.Tensor, bool]] = []
        self.in_backward = False

    def __call__(self, flat: torch.Tensor) -> Any:
        index = next(i for i, f in enumerate(self.buckets.flats) if f is flat)
        self.launched.append((index, flat.clone(), self.in_backward))
        return None


def _step(model: nn.Module, x: torch.Tensor, passes: int) -> None:
    for chunk in x.chunk(passes):
        model(chunk).pow(2).sum().backward()


def test_the_last_pass_launches_every_bucket_once_in_order_with_its_whole_gradient() -> None:
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    # Tiny buckets: one or two parameters each, so that order and overlap show.
    buckets = GradientBuckets(params, first_bytes=64, bytes_per_bucket=1024)
    record = Recorder(buckets)
    x = torch.randn(12, 8)

    chunks = x.chunk(3)
    for n, chunk in enumerate(chunks):
        if n == len(chunks) - 1:
            buckets.arm(record)
        record.in_backward = True
        model(chunk).pow(2).sum().backward()
        record.in_backward = False
    buckets.launch_rest()
    _step(plain, x, 3)

    assert [i for i, _, _ in record.launched] == list(range(len(buckets.plan)))
    # The used parameters' buckets went while the backward pass still ran; the unused
    # layer's (the last) only after it.
    assert buckets.plan == [[7, 6], [5, 4], [3, 2], [1, 0]]
    assert [during for _, _, during in record.launched] == [True] * (len(buckets.plan) - 1) + [
        False
    ]
    # Each launched bucket held its parameters' whole gradient: all three passes summed.
    for index, held, _ in record.launched:
        plain_params = list(plain.parameters())
        expected = [
            plain_params[i].grad.reshape(-1)
            if plain_params[i].grad is not None
            else torch.zeros(params[i].numel())
            for i in buckets.plan[index]
        ]
        assert torch.equal(held, torch.cat(expected)), index
    # The gradients are the buckets' memory: an all-reduce in place is the gradient.
    for p, view in zip(params, buckets.views, strict=True):
        assert p.grad is view


def test_a_gradient_replaced_by_the_user_goes_back_into_its_bucket() -> None:
    model = Net()
    params = list(model.parameters())
    buckets = GradientBuckets(params)
    params[0].grad = torch.ones_like(params[0])  # e.g. set_to_none, or a user's own grad
    buckets.arm(lambda flat: None)
    buckets.launch_rest()
    assert params[0].grad is buckets.views[0]
    assert torch.equal(buckets.views[0], torch.ones_like(params[0]))


def test_renew_leaves_the_old_buffers_to_an_abandoned_all_reduce() -> None:
    model = Net()
    params = list(model.parameters())
    buckets = GradientBuckets(params)
    old = buckets.flats[0]
    buckets.renew()
    assert buckets.flats[0] is not old
    assert params[-1].grad is buckets.views[-1]
    old.fill_(7.0)  # a late all-reduce writing into what it was given
    assert all(float(p.grad.abs().sum()) == 0.0 for p in params if p.grad is not None)


def test_a_gradient_accumulated_twice_in_one_pass_is_refused() -> None:
    from torch.utils.checkpoint import checkpoint

    layer = nn.Linear(4, 4)
    buckets = GradientBuckets(list(layer.parameters()))
    buckets.arm(lambda flat: None)
    x = torch.randn(2, 4, requires_grad=True)
    # Reentrant checkpointing runs a backward pass of its own for the checkpointed use.
    y = checkpoint(layer, x, use_reentrant=True) + layer(x)
    with pytest.raises(RuntimeError, match="accumulated twice"):
        y.sum().backward()
