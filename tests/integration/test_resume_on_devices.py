"""A run resumed from its middle checkpoint ends bit for bit where the uninterrupted run
ends, on the CPU and on a CUDA GPU, in each precision: the checkpoint carries the parameters,
the optimizer, the fp16 gradient scaler and every random generator (the model has dropout).
On the GPU the same code runs on NCCL, and DDP's gradient hooks are checked on NCCL too.

The ``elastic.train.context`` code a worker runs, in this process and without Ray (the loop needs
none). On the GPU the process group is NCCL with one rank: NCCL refuses two ranks on one
GPU. The CUDA cases are skipped without a GPU (CI has none); on a GPU machine:
``python -m pytest --noconftest tests/integration/test_resume_on_devices.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from elastic.checkpoint.storage import MANIFEST, sha256_of
from elastic.train.context import TrainContext, run_with_context
from elastic.train.distributed import DistributedOptions, register_compression
from elastic.train.worker import WorkerContext

STEPS = 12
EVERY = 6
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [
    ("cpu", "fp32"),
    ("cpu", "bf16"),
    pytest.param("cuda", "fp32", marks=needs_gpu),
    pytest.param("cuda", "bf16", marks=needs_gpu),
    pytest.param("cuda", "fp16", marks=needs_gpu),
]


class DropoutNet(nn.Module):
    """Dropout makes the run depend on the device's random generator."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[no-any-return]


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(384, 16, generator=g)
    return TensorDataset(x, x[:, :4].argmax(dim=1))


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[torch.device]:
    """CUDA device 0 in an NCCL process group of one, with deterministic kernels: bit for
    bit results on a GPU need cuBLAS's fixed workspace."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    assert dist.get_backend() == "nccl"
    yield device
    dist.destroy_process_group()
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda":
        return request.getfixturevalue("nccl")  # type: ignore[no-any-return]
    return torch.device("cpu")


def scramble(device: torch.device) -> None:
    """What a fresh process's generators hold: anything but the checkpoint's streams."""
    torch.manual_seed(12345)
    if device.type == "cuda":
        torch.cuda.manual_seed(12345)


def train(
    root: Path, device: torch.device, precision: str, resume: Path | None = None
) -> dict[str, Any]:
    facts: dict[str, Any] = {"params": {}, "dtypes": set(), "scale": {}}

    def loop(config: dict[str, Any], ctx: TrainContext) -> None:
        torch.manual_seed(1)  # every attempt builds the same model; a checkpoint overrides it
        model = ctx.prepare_model(DropoutNet())
        ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        model.head.register_forward_hook(  # type: ignore[union-attr]
            lambda m, i, out: facts["dtypes"].add(out.dtype)
        )
        if resume is not None:
            scramble(device)
        for batch in ctx.batches(dataset(), global_batch_size=32, max_steps=STEPS, seed=7):
            ctx.train_step(batch, nn.CrossEntropyLoss(reduction="none"))
            facts["params"][batch.step] = torch.cat(
                [p.detach().flatten().cpu() for p in model.parameters()]
            )
            if ctx.precision.scaler is not None:
                facts["scale"][batch.step] = float(ctx.precision.scaler.get_scale())
        facts["device"] = next(model.parameters()).device

    worker = WorkerContext.standalone(
        0,
        1,
        str(root),
        every_steps=EVERY,
        resume_path=None if resume is None else str(resume),
        device=device,
    )
    run_with_context(loop, {"distributed": {"precision": precision}}, worker)
    facts["losses"] = {d["step"]: d["loss"] for k, d in worker.local_events if k == "metrics"}
    return facts


def middle(root: Path) -> Path:
    return root / f"step_{EVERY:010d}"


@pytest.mark.parametrize(("device", "precision"), CASES, indirect=["device"])
def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_ends(
    tmp_path: Path, device: torch.device, precision: str
) -> None:
    whole = train(tmp_path / "whole", device, precision)
    assert whole["device"] == device
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert whole["dtypes"] == {expected[precision]}
    assert sorted(whole["losses"]) == list(range(1, STEPS + 1))
    assert whole["losses"][STEPS] < whole["losses"][1], whole["losses"]

    state = torch.load(middle(tmp_path / "whole") / "state.pt", weights_only=True)
    (streams,) = state["rng"]["per_rank"]
    assert ("cuda" in streams) == (device.type == "cuda")
    if precision == "fp16":
        assert state["grad_scaler"]["scale"] == whole["scale"][EVERY]
    else:
        assert state["grad_scaler"] is None

    resumed = train(tmp_path / "resumed", device, precision, resume=middle(tmp_path / "whole"))
    assert sorted(resumed["params"]) == list(range(EVERY + 1, STEPS + 1))
    for step in range(EVERY + 1, STEPS + 1):
        assert torch.equal(resumed["params"][step], whole["params"][step]), step
        assert resumed["losses"][step] == whole["losses"][step], step
    assert resumed["scale"] == {s: whole["scale"][s] for s in resumed["scale"]}


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=needs_gpu)], indirect=["device"]
)
def test_without_the_saved_stream_the_resumed_run_differs(
    tmp_path: Path, device: torch.device
) -> None:
    """The control of the test above: the same resume with the device's stream in the
    checkpoint replaced diverges, so the equality above is the restored stream's doing."""
    whole = train(tmp_path / "whole", device, "fp32")
    folder = middle(tmp_path / "whole")
    state = torch.load(folder / "state.pt", weights_only=True)
    (streams,) = state["rng"]["per_rank"]
    torch.manual_seed(999)
    if device.type == "cuda":
        torch.cuda.manual_seed(999)
        streams["cuda"] = torch.cuda.get_rng_state()
    else:
        streams["torch"] = torch.get_rng_state()
    torch.save(state, folder / "state.pt")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["state.pt"] = {
        "size": (folder / "state.pt").stat().st_size,
        "sha256": sha256_of(folder / "state.pt"),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    resumed = train(tmp_path / "resumed", device, "fp32", resume=folder)
    assert not torch.equal(resumed["params"][EVERY + 1], whole["params"][EVERY + 1])


@needs_gpu
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "powersgd"])
def test_ddp_on_nccl_with_each_gradient_hook_trains(nccl: torch.device, compression: str) -> None:
    """DDP's NCCL all-reduce with the job's compression hook (``register_compression``), at
    a world of one: the reduced gradient is the local one, through the hook's casts."""
    torch.manual_seed(3)
    plain = DropoutNet().to(nccl).eval()  # eval: no dropout, both sides compute one function
    model = DropoutNet().to(nccl).eval()
    model.load_state_dict(plain.state_dict())
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=1)
    options = DistributedOptions(
        gradient_compression=compression, powersgd_rank=2, powersgd_start_step=2
    )
    register_compression(ddp, options)
    x, y = dataset().tensors
    x, y = x[:64].to(nccl), y[:64].to(nccl)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(3):
        ddp.zero_grad()
        plain.zero_grad()
        loss_fn(ddp(x), y).backward()
        loss_fn(plain(x), y).backward()
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.isfinite(a.grad).all()
            if compression == "none":
                assert torch.equal(a.grad, b.grad)
            elif compression in ("fp16", "bf16"):
                # One cast there and back: the gradient to the format's precision.
                tol = 1e-3 if compression == "fp16" else 1e-2
                assert torch.allclose(a.grad, b.grad, rtol=tol, atol=1e-6)
        with torch.no_grad():
            for a, b in zip(model.parameters(), plain.parameters(), strict=True):
                a -= 0.1 * a.grad  # type: ignore[operator]
                b -= 0.1 * b.grad  # type: ignore[operator]
    hooks = [h.__name__ for h, _ in getattr(ddp, "_comm_hooks", [])]
    expected = {"none": [], "fp16": ["fp16_compress_hook"], "bf16": ["bf16_compress_hook"]}
    assert hooks == expected.get(compression, ["powerSGD_hook"])
