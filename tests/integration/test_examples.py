"""The three example scripts (examples/<name>/) on the real service: each plain script
unchanged as a command job on one worker, and each ctx port as an entrypoint job on two."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from elastic_train import Client
from tests.conftest import TOKEN, ClusterPool, LiveServer, make_settings
from tests.integration.test_command_jobs import ended, log_text

EXAMPLES = Path(__file__).parents[2] / "examples"


def write_fake_mnist(root: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "fake_mnist", EXAMPLES / "mnist" / "fake_mnist.py"
    )
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_fake_mnist(root, train=256, test=64)


def run(server: LiveServer, name: str, spec: dict[str, Any]) -> tuple[dict[str, Any], str]:
    api = server.client()
    with Client(server.url, TOKEN) as client:
        job = client.submit(
            {"name": name, "failure": {"max_restarts": 0}, **spec}, code=EXAMPLES / name
        )
    final = ended(api, job.id, timeout=240)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    return final, text


def command(*args: str) -> dict[str, Any]:
    return {
        "command": ["python", "main.py", *args],
        "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
    }


def entrypoint(*args: str) -> dict[str, Any]:
    return {
        "entrypoint": "loop.py:main",
        "hyperparameters": {"args": list(args)},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": 100},
    }


def lrs(text: str) -> list[str]:
    return re.findall(r"Train Epoch: \d+ \[0/256\]\tlr: ([0-9.]+)", text)


def test_mnist_as_a_command_and_as_a_loop(ray_cluster: ClusterPool, tmp_path: Path) -> None:
    # A data root apart from the service's files (a root holding them is not readable).
    data = tmp_path / "data"
    write_fake_mnist(data)
    with LiveServer(make_settings(tmp_path / "svc", data_roots=[str(data)])) as server:
        mnist_both_ways(server, data)


def mnist_both_ways(server: LiveServer, data: Path) -> None:
    _, text = run(
        server,
        "mnist",
        command(
            "--data", str(data), "--epochs", "2", "--batch-size", "64", "--log-interval", "100"
        ),
    )
    assert lrs(text) == ["1.000000", "0.700000"], text  # StepLR, 0.7 a epoch
    assert len(re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: \d+/64", text)) == 2
    assert "Done: 2 epochs" in text
    final, text = run(
        server,
        "mnist",
        entrypoint(
            "--data", str(data), "--epochs", "3", "--batch-size", "64", "--log-interval", "100"
        ),
    )
    assert final["step"] == 12  # 3 epochs of 256 samples, 64 a step
    # Both ranks print, in either order; the rate each epoch is the loop's own StepLR's.
    rates = sorted(lrs(text), reverse=True)
    assert rates == ["1.000000"] * 2 + ["0.700000"] * 2 + ["0.490000"] * 2, text
    assert text.count("Done: 3 epochs") == 2


def test_resnet_as_a_command_and_as_a_loop(server: LiveServer) -> None:
    tiny = (
        "--epochs",
        "1",
        "--train-size",
        "128",
        "--test-size",
        "64",
        "--batch-size",
        "32",
        "--width",
        "8",
        "--print-freq",
        "100",
    )
    _, text = run(server, "resnet", command(*tiny))
    assert re.search(r"epoch 0 eval accuracy [0-9.]+ \(\d+/64\)", text), text
    assert "Done: 1 epochs" in text
    final, text = run(server, "resnet", entrypoint(*tiny))
    assert final["step"] == 4  # 128 samples, 32 a step
    assert len(re.findall(r"epoch 0 eval accuracy [0-9.]+ \(\d+/64\)", text)) == 2, text
    assert text.count("Done: 1 epochs") == 2


def test_text_as_a_command_and_as_a_loop(server: LiveServer) -> None:
    tiny = (
        "--epochs",
        "1",
        "--train-size",
        "128",
        "--eval-size",
        "64",
        "--batch-size",
        "32",
        "--logging-steps",
        "2",
    )
    _, text = run(server, "text", command(*tiny))
    assert "step 4 epoch 0 loss" in text and "Done: 4 steps" in text, text
    final, text = run(server, "text", entrypoint(*tiny))
    assert final["step"] == 4
    assert text.count("Done: 4 steps") == 2, text
    assert len(re.findall(r"epoch 0 eval_accuracy [0-9.]+", text)) == 2
