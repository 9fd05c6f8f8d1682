"""MLflow logging of a job, by its rank-0 worker, when the service has a tracking URI.

The launcher hands each job's processes ``MLFLOW_TRACKING_URI`` (and the experiment name and
MLflow's credential variables) through the supervisor's ``runtime_env``, and puts what the
run is about under ``config["_mlflow"]``: the job id, its name and its world-size bounds.

One MLflow run per job: each attempt's rank 0 finds the run tagged ``etrain.job_id`` (a
restart after a failure, a resize, a re-created supervisor) and goes on logging into it, or
creates it (with the job's hyperparameters and bounds as params) on the first attempt.
Metrics are logged with the job's step as MLflow's step; each attempt adds a tag
``etrain.attempt.<n>`` saying at which world size and from which checkpoint it began.

Everything MLflow does happens on a background thread: importing mlflow takes seconds and
every call is a request to the tracking server, and training must wait on neither. A
failure to log is logged and dropped, never raised. The run ends ``FINISHED`` when an attempt
trains the job's last step, ``FAILED`` when the attempt's train loop raised (a later attempt
sets it back to ``RUNNING``); an attempt stopped from outside (a cancel, a lost node) cannot
end it, so the run of a cancelled job stays ``RUNNING``.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import sys
import threading
import time
from typing import Any

from elastic.events import EventKind
from elastic.train.tensorboard import SCALARS

log = logging.getLogger(__name__)

CONFIG_KEY = "_mlflow"
URI_VARIABLE = "MLFLOW_TRACKING_URI"
EXPERIMENT_VARIABLE = "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "elastic-train"
JOB_TAG = "etrain.job_id"
ATTEMPT_TAG = "etrain.attempt."
# How long close() waits for the queue to drain before the worker process goes on ending.
CLOSE_TIMEOUT_S = 30.0
# MLflow's limits: 100 params per batch, 6000 characters per value; keys of these characters.
_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-./ ]")
_CLOSE = object()


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested hyperparameters as MLflow params: ``{"a": {"b": 1}}`` is ``a.b = "1"``; keys
    with characters MLflow refuses get ``_`` in their place."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = _BAD_KEY_CHARS.sub("_", f"{prefix}{key}")
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:_MAX_PARAM_VALUE]
    return out


def for_worker(
    config: dict[str, Any], attempt: int, world_size: int, step: int
) -> MlflowLog | None:
    """The MLflow log of this attempt's rank 0, or None when the job has none configured."""
    meta = config.get(CONFIG_KEY)
    uri = os.environ.get(URI_VARIABLE)
    if not isinstance(meta, dict) or not meta.get("job_id") or not uri:
        return None
    params = flatten(config.get("hyperparameters") or {}, "hyperparameters.")
    params.update(flatten(config.get("distributed") or {}, "distributed."))
    params.update(
        {
            "etrain.job_name": str(meta.get("job_name", "")),
            "etrain.min_workers": str(meta.get("min_workers", "")),
            "etrain.max_workers": str(meta.get("max_workers", "")),
        }
    )
    return MlflowLog(
        uri,
        os.environ.get(EXPERIMENT_VARIABLE) or DEFAULT_EXPERIMENT,
        str(meta["job_id"]),
        str(meta.get("job_name") or meta["job_id"]),
        params,
        attempt,
        world_size,
        step,
    )


class MlflowLog:
    """One attempt's share of the job's MLflow run; ``record`` and ``close`` never block on
    MLflow (close waits at most :data:`CLOSE_TIMEOUT_S`)."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        job_id: str,
        run_name: str,
        params: dict[str, str],
        attempt: int,
        world_size: int,
        step: int,
    ) -> None:
        self.uri = uri
        self.experiment = experiment
        self.job_id = job_id
        self.run_name = run_name
        self.params = params
        self.attempt = attempt
        how = f"from the checkpoint of step {step}" if step > 0 else "from the start"
        self.marker = f"began at world size {world_size}, {how}"
        self.run_id: str | None = None
        self._last_step_trained = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="etrain-mlflow", daemon=True)
        self._thread.start()

    def record(self, kind: str, data: dict[str, Any]) -> None:
        if kind == EventKind.METRICS:
            step = int(data["step"])
            if step == data.get("total_steps"):
                self._last_step_trained = True
            self._queue.put((step, time.time(), dict(data)))

    def close(self) -> None:
        """End this attempt's logging; the run's status follows how the attempt ended (an
        exception being handled now: failed)."""
        status: str | None
        if sys.exc_info()[0] is not None:
            status = "FAILED"
        elif self._last_step_trained:
            status = "FINISHED"
        else:
            status = None  # paused for a resize: the next attempt goes on with the run
        self._queue.put((_CLOSE, status))
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("MLflow log: still busy after %.0f s, left behind", CLOSE_TIMEOUT_S)

    # -- the background thread -----------------------------------------------------------

    def _work(self) -> None:
        client = None
        try:
            client = self._open()
        except Exception as e:  # an unreachable server, mlflow missing on this node
            log.warning("MLflow log: cannot open the run of job %s: %s", self.job_id, e)
        while True:
            item = self._queue.get()
            if item[0] is _CLOSE:
                if client is not None and self.run_id is not None and item[1] is not None:
                    self._call(client.set_terminated, self.run_id, item[1])
                return
            if client is not None and self.run_id is not None:
                self._log_metrics(client, *item)

    def _open(self) -> Any:
        from mlflow import MlflowClient  # optional: only a configured service needs it
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=self.uri)
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(self.experiment)
            except Exception:  # another job created it first
                experiment = client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        runs = client.search_runs(
            [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{self.job_id}'", max_results=1
        )
        if runs:
            self.run_id = runs[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(
                experiment_id, run_name=self.run_name, tags={JOB_TAG: self.job_id}
            )
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in self.params.items()]
            for i in range(0, len(params), _PARAMS_PER_BATCH):
                client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_BATCH])
        client.set_tag(self.run_id, f"{ATTEMPT_TAG}{self.attempt}", self.marker)
        return client

    def _log_metrics(self, client: Any, step: int, at: float, data: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        millis = int(at * 1000)
        metrics = [
            Metric(key, float(value), millis, step)
            for field, key in SCALARS.items()
            if isinstance(value := data.get(field), int | float) and math.isfinite(value)
        ]
        if metrics:
            self._call(client.log_batch, self.run_id, metrics=metrics)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:
            log.warning("MLflow log: %s", e)
