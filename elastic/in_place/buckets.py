"""Gradient buckets for an in-place replica: its all-reduce overlaps the step's last
backward pass, as DDP's does.

Every parameter's ``.grad`` is a view into one flat buffer per bucket (so a bucket is
all-reduced in place: no concatenation before, no copy back after). During the step's
last backward pass, a parameter's post-accumulate hook marks it ready; once a bucket's
parameters are all ready it is launched, always in bucket order, so every replica issues
the same collectives in the same order whatever order autograd fires the hooks in. The
buckets not launched by the end of the backward pass (unused parameters, a replica with no
samples in the step) are launched then.

Buckets follow the parameters in reverse, as backward roughly produces their gradients;
the first is small so that communication starts early (DDP's choice too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def plan_buckets(
    sizes: Sequence[tuple[torch.dtype, int]],
    first_bytes: int = FIRST_BUCKET_BYTES,
    bytes_per_bucket: int = BUCKET_BYTES,
) -> list[list[int]]:
    """Parameter indices per bucket, given each parameter's (dtype, element count): the
    parameters in reverse order, a new bucket when the dtype changes or the bucket is full
    (the first one at ``first_bytes``)."""
    buckets: list[list[int]] = []
    filled, dtype = 0, None
    for index in reversed(range(len(sizes))):
        param_dtype, numel = sizes[index]
        cap = first_bytes if len(buckets) <= 1 else bytes_per_bucket
        if not buckets or param_dtype != dtype or filled >= cap:
            buckets.append([])
            filled, dtype = 0, param_dtype
        buckets[-1].append(index)
        filled += numel * param_dtype.itemsize
    return buckets


class GradientBuckets:
    """Owns the gradients of ``params``: call :meth:`arm` before the step's last backward
    pass and :meth:`launch_rest` after it."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        first_bytes: int = FIRST_BUCKET_BYTES,
        bytes_per_bucket: int = BUCKET_BYTES,
    ) -> None:
        self.params = params
        sizes = [(p.dtype, p.numel()) for p in params]
        self.plan = plan_buckets(sizes, first_bytes, bytes_per_bucket)
        self.bucket_of = [0] * len(params)
        for b, indices in enumerate(self.plan):
            for i in indices:
                self.bucket_of[i] = b
        self.flats: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        self.renew()
        self._launch: Callable[[torch.Tensor], Any] | None = None
        self._missing: list[int] = []
        self._ready: list[bool] = []
        self._next = 0
        self.works: list[Any] = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def renew(self) -> None:
        """Fresh buffers: after a step was abandoned, its collectives may still write into
        the old ones (a peer that was dropped but lives on); they are left to them."""
        params = self.params
        self.flats, self.views = [], [torch.empty(0)] * len(params)
        for indices in self.plan:
            first = params[indices[0]]
            size = sum(params[i].numel() for i in indices)
            flat = torch.zeros(size, dtype=first.dtype, device=first.device)
            offset = 0
            for i in indices:
                n = params[i].numel()
                self.views[i] = flat[offset : offset + n].view_as(params[i])
                offset += n
            self.flats.append(flat)
        for p, view in zip(params, self.views, strict=True):
            p.grad = view

    def attach(self) -> None:
        """Point every ``.grad`` at its view (after anything that replaced it)."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is not view:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(param: torch.Tensor) -> None:
            view = self.views[index]
            if param.grad is not view:
                # Autograd accumulated out of place (the grad was shared): back into the bucket.
                assert param.grad is not None
                view.copy_(param.grad)
                param.grad = view
            if self._launch is None:
                return  # not the step's last backward pass
            if self._ready[index]:
                # A bucket launched before this second gradient would miss it.
                raise RuntimeError(
                    "a parameter's gradient was accumulated twice in one backward pass "
                    "(reentrant activation checkpointing?): in place cannot all-reduce it "
                    "early; use fault_tolerance 'restart'"
                )
            self._ready[index] = True
            self._missing[self.bucket_of[index]] -= 1
            self._launch_ready()

        return ready

    def arm(self, launch: Callable[[torch.Tensor], Any]) -> None:
        """The next backward pass is the step's last: ``launch(flat)`` starts a bucket's
        all-reduce (in place) and returns its work."""
        self.attach()
        self._launch = launch
        self._missing = [len(indices) for indices in self.plan]
        self._ready = [False] * len(self.params)
        self._next = 0
        self.works = []

    def _launch_ready(self) -> None:
        assert self._launch is not None
        while self._next < len(self.plan) and self._missing[self._next] == 0:
            self.works.append(self._launch(self.flats[self._next]))
            self._next += 1

    def launch_rest(self) -> list[Any]:
        """Launch the buckets the backward pass did not complete, in order; the step's works."""
        assert self._launch is not None
        self.attach()
        while self._next < len(self.plan):
            self.works.append(self._launch(self.flats[self._next]))
            self._next += 1
        self._launch = None
        return self.works
