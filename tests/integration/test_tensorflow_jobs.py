"""A TensorFlow command job (``framework: tensorflow``): a Keras script, unchanged, trains
with MultiWorkerMirroredStrategy from the TF_CONFIG every worker is given, with TensorFlow
installed by the job's own requirements; after a node loss it starts again at the smaller
size and resumes from its BackupAndRestore directory in ETRAIN_CHECKPOINT_DIR. A real Ray
cluster through the real service, a real pip install from the package index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import ray

from elastic_train import Client
from tests.conftest import TOKEN, ClusterPool, LiveServer, all_events, wait_for
from tests.integration.test_command_jobs import ended, log_text

KERAS_DIR = Path(__file__).parents[1] / "workloads" / "keras_script"
# What a user of Keras 2 on TensorFlow asks for: tf-keras pins its tensorflow (not
# tensorflow-cpu), and Keras 3, which TensorFlow brings, cannot fit a model under
# MultiWorkerMirroredStrategy (see docs/custom-code.md).
REQUIREMENTS = ["tensorflow==2.21.0", "tf-keras==2.21.0"]
EPOCHS = 8


def reference(epochs: int) -> dict[str, Any]:
    """The script's weights after ``epochs`` epochs in one process, never interrupted: SGD
    on the mean squared error from zeros, one global batch a step (in NumPy, float64)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32").astype("float64")
    truth = np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")
    y = (x.astype("float32") @ truth + np.float32(0.1)).astype("float64")
    kernel, bias = np.zeros((4, 1)), np.zeros(1)
    for _ in range(epochs):
        for step in range(4):
            xb, yb = x[step * 16 : (step + 1) * 16], y[step * 16 : (step + 1) * 16]
            error = xb @ kernel + bias - yb
            kernel -= 0.05 * 2 * xb.T @ error / 16
            bias -= 0.05 * 2 * error.sum(0) / 16
    return {"kernel": kernel, "bias": bias}


def test_a_framework_other_than_the_known_ones_is_refused(server: LiveServer) -> None:
    api = server.client()
    spec = {"name": "tf", "command": ["python", "train.py"], "framework": "jax"}
    refused = api.post("/v1/jobs", json=spec)
    assert refused.status_code == 422
    assert refused.json()["errors"] == [
        {
            "field": "framework",
            "message": "unknown framework 'jax': use one of pytorch, tensorflow (for a "
            "Horovod script, see docs/horovod.md)",
        }
    ]
    without = {"name": "tf", "workload": "image-classification", "framework": "tensorflow"}
    refused = api.post("/v1/jobs", json=without)
    assert refused.status_code == 422
    assert [e["field"] for e in refused.json()["errors"]] == ["framework"]


def test_a_keras_script_trains_on_two_workers_and_resumes_at_one_after_a_node_loss(
    server: LiveServer, ray_cluster: ClusterPool
) -> None:
    api = server.client()
    # Two nodes: the job's two workers, and none to take the lost one's place.
    ray_cluster.kill_node(ray_cluster.pool[0])
    wait_for(lambda: ray.cluster_resources().get("CPU", 0) == 2, 60, what="a pool of 2")
    spec = {
        "name": "keras",
        "command": ["python", "train.py", "--epochs", str(EPOCHS), "--pace", "2"],
        "framework": "tensorflow",
        "requirements": REQUIREMENTS,
        "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
        "failure": {"max_restarts": 3, "min_workers_grace_s": 60},
    }
    with Client(server.url, TOKEN) as client:
        job = client.submit(spec, code=KERAS_DIR)

    def points() -> list[dict[str, Any]]:
        return [e["data"] for e in all_events(api, job.id, "metrics") if "loss" in e["data"]]

    # Two epochs trained at 2 (installing TensorFlow comes first: minutes on a cold node).
    wait_for(
        lambda: any(p["world_size"] == 2 and p["step"] >= 2 for p in points()),
        420,
        interval=1.0,
        what="epoch 2 at 2 workers",
    )
    ray_cluster.kill_node(ray_cluster.pool[1])
    final = ended(api, job.id, timeout=300)
    text = log_text(api, job.id)
    assert final["state"] == "succeeded", text
    assert final["restarts"] == 1
    assert ("installing the requirements: pip install " + " ".join(REQUIREMENTS)) in text or (
        "requirements: installed on this node already" in text
    ), text

    # Rank 0's view of each run: MultiWorkerMirroredStrategy saw 2 replicas, then 1.
    starts = [line for line in text.splitlines() if line.startswith("worker 0 of ")]
    assert [line.split(" of ")[1].split(" ")[0] for line in starts] == ["2", "1"], starts
    assert [line.rsplit("(", 1)[1] for line in starts] == ["restart 0)", "restart 1)"], starts
    resumed = [int(line.split("at epoch ")[1].split(" ")[0]) for line in starts]
    at_two = [p["step"] for p in points() if p["world_size"] == 2]
    at_one = [p["step"] for p in points() if p["world_size"] == 1]
    # The first run started from nothing; the second where the last backup was: at least
    # the last epoch reported at 2 (each epoch's backup is written before its report).
    assert resumed[0] == 0 and max(at_two) <= resumed[1] < EPOCHS, (starts, at_two)
    assert at_two == list(range(1, len(at_two) + 1))
    assert at_one == list(range(resumed[1] + 1, EPOCHS + 1))
    assert f"done at epoch {EPOCHS} ({EPOCHS - resumed[1]} trained in this run)" in text
    assert final["step"] == EPOCHS

    # The weights are the uninterrupted run's: the restart resumed from the backup.
    line = next(line for line in text.splitlines() if line.startswith("weights "))
    weights = json.loads(line[len("weights ") :])
    expected = reference(EPOCHS)
    np.testing.assert_allclose(weights["kernel"], expected["kernel"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(weights["bias"], expected["bias"], rtol=0, atol=1e-5)
