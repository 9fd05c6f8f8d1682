"""Recovery after a node failure: stock Ray Train 2.60 elastic, Ray Train 2.60 with
torchft, torchrun elastic, and elastic-train in both of its modes.

One process, one cluster (a head that trains nothing and three one-CPU nodes, from
ray.cluster_utils.Cluster; torchrun runs its three agents on the same machine): the same
job on every side (the small CNN on synthetic 32x32 images, global batch 60 at any world
size, a checkpoint every 10 steps where the side uses them, STEPS steps). On each side the
worker of rank 1 loses its node (the raylet killed, not a polite shutdown; for torchrun its
agent's process group SIGKILLed) once step KILL_AT_STEP is seen, and a node is added back
once the smaller world has reached GROW_AT_STEP. The sides rotate (each takes each place in
the order in turn), --repeat times.

Every side records each step (when, which rank, which attempt, how many participants,
committed or thrown away, which samples); one summary (``bench/recovery_records.py``)
turns those records into every row, so every side is measured the same way. For ours the
records are the job's own metrics events and its sample audit; ours also shows the job's
own figures (recovery_seconds, pause_seconds) as its events report them.

After the table, ``bench/recovery_plot.py`` draws the runs (``--plot``, a PNG,
docs/img/recovery.png unless told otherwise; ``--plot ''`` draws nothing): a panel per
side, its optimizer steps against the seconds since the kill in the run of the side's
median recovery, with the steps thrown away or redone and the world size of each.

    .venv/bin/python -m bench.recovery --repeat 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.cluster_utils import Cluster

from bench.recovery_ray import (
    BATCH,
    EVERY,
    GROW_AT_STEP,
    KILL_AT_STEP,
    NAMESPACE,
    STEPS,
    Run,
    fresh_nodes,
    kill_and_grow,
    run_ray_torchft,
    run_stock,
)
from bench.recovery_records import HEADERS, SIDES, StepRecord, summarize
from jobs.launcher import FAST_FAILURE_DETECTION, keep_ray_on_loopback

ENDED = ("succeeded", "failed", "cancelled")


def serve(data_dir: str) -> tuple[Any, threading.Thread, httpx.Client]:
    """The service in a thread of this process, on this process's Ray connection."""
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    settings = Settings(
        data_dir=Path(data_dir),
        api_token="bench",  # type: ignore[arg-type]
        ray_namespace=NAMESPACE,
        event_poll_interval_s=0.1,
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer bench"}, timeout=30
    )
    return server, thread, client


def job_spec(steps: int, mode: str) -> dict[str, Any]:
    """The small CNN job every side runs, through the service."""
    return {
        "name": "bench",
        "workload": "image-classification",
        "hyperparameters": {
            "model": "small_cnn",
            "dataset": "synthetic",
            "max_steps": steps,
            "global_batch_size": BATCH,
            "learning_rate": 0.05,
            "seed": 0,
            "synthetic_samples": 100_000,
            "record_samples": True,
        },
        "scaling": {"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1},
        "checkpoint": {"every_steps": EVERY, "keep": 3},
        "fault_tolerance": mode,
    }


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


class JobEvents:
    """A job's events, read page after page and then only the new ones on each call."""

    def __init__(self, client: httpx.Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.items: list[dict[str, Any]] = []
        self.after = 0

    def __call__(self) -> list[dict[str, Any]]:
        while True:
            page = self.client.get(
                f"/v1/jobs/{self.job_id}/events", params={"after": self.after, "limit": 1000}
            ).json()
            self.items += page["items"]
            if page["next_after"] == self.after:
                return self.items
            self.after = page["next_after"]


def metrics_records(events: list[dict[str, Any]]) -> list[StepRecord]:
    """One record per committed step, from the job's metrics events (rank 0 reports each)."""
    return [
        StepRecord(
            stamp(e), 0, e["data"]["step"], str(e["data"]["attempt"]), e["data"]["world_size"], True
        )
        for e in events
        if e["kind"] == "metrics"
    ]


def with_samples(records: list[StepRecord], job_root: Path) -> list[StepRecord]:
    """The records with the samples of each (attempt, step) from the job's sample audit:
    in restart mode each rank writes its share; in place each committing replica writes the
    whole step, so one replica's record is the step's."""
    shares: dict[tuple[str, int], list[int]] = {}
    whole: dict[tuple[str, int], list[int]] = {}
    for f in sorted((job_root / "samples").iterdir()):
        target = whole if "replica" in f.name else shares
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = (str(r["a"]), r["s"])
            if target is whole:
                whole.setdefault(key, r["i"])
            else:
                shares.setdefault(key, []).extend(r["i"])
    return [
        dataclasses.replace(
            r,
            indices=tuple(whole.get((r.attempt, r.step)) or shares.get((r.attempt, r.step)) or ()),
        )
        for r in records
    ]


def run_ours(
    cluster: Cluster, nodes: list[Any], data_dir: str, mode: str
) -> tuple[Run, dict[str, float]]:
    server, thread, client = serve(data_dir)
    started = time.time()
    job_id = client.post("/v1/jobs", json=job_spec(STEPS, mode)).json()["id"]

    def rank1_node() -> str | None:
        supervisor = ray.get_actor(f"etrain-supervisor-{job_id}", namespace=NAMESPACE)
        status: Any = ray.get(supervisor.status.remote())
        node: str | None = status["worker_nodes"].get(1)
        return node

    def ended() -> bool:
        return client.get(f"/v1/jobs/{job_id}").json()["state"] in ENDED

    events = JobEvents(client, job_id)
    killed_at, added_at = kill_and_grow(
        lambda: metrics_records(events()), rank1_node, cluster, nodes, ended
    )
    while not ended():
        time.sleep(0.2)
    final = client.get(f"/v1/jobs/{job_id}").json()
    items = events()
    server.should_exit = True
    thread.join(timeout=30)
    assert final["state"] == "succeeded", final
    records = with_samples(metrics_records(items), Path(data_dir) / "checkpoints" / job_id)
    # The job's own account of the loss, as its events report it.
    if mode == "in_place":
        lost = next(e["data"] for e in items if e["kind"] == "worker_lost")
        reported = {
            "reported_s": lost["recovery_seconds"],
            "reported_pause_s": lost["pause_seconds"],
            "reported_redone": lost["steps_redone"],
        }
    else:
        shrink = next(e["data"] for e in items if e["kind"] == "resized")
        reported = {"reported_s": shrink["recovery_seconds"]}
    return (records, started, killed_at, added_at), reported


def run_torchrun_side(work: str) -> Run:
    from bench.recovery_torchrun import run_torchrun

    return run_torchrun(work, STEPS, KILL_AT_STEP, GROW_AT_STEP, BATCH, EVERY)


ROWS = [
    ("kill to first step at the smaller size (s)", "recovery_s", "{:.2f}"),
    ("supervisor killed to its successor's word (s)", "supervisor_back_s", "{:.2f}"),
    ("kill to the first step after that word (s)", "resumed_s", "{:.2f}"),
    ("longest training pause after the kill (s)", "pause_s", "{:.2f}"),
    ("steps redone", "steps_redone", "{:.0f}"),
    ("samples lost in the final model", "samples_lost", "{:.0f}"),
    ("samples trained twice in the final model", "samples_doubled", "{:.0f}"),
    ("node back to first step at the bigger size (s)", "grow_s", "{:.1f}"),
    ("longest pause while growing (s)", "grow_pause_s", "{:.2f}"),
    ("samples/s at 3 workers before the kill", "steady_sps", "{:.0f}"),
    ("wall time, start to the last step (s)", "wall_s", "{:.1f}"),
    ("runs that grew back before the end", "grew", "{:.0f}"),
    ("split brain: replicas that retrained alone", "split_brain", "{:.0f}"),
    ("attempts (1: no restart)", "attempts", "{:.0f}"),
    ("ours as reported: recovery_seconds", "reported_s", "{:.2f}"),
    ("ours as reported: pause_seconds", "reported_pause_s", "{:.2f}"),
    ("ours as reported: steps_redone", "reported_redone", "{:.0f}"),
]


def _cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    mid = fmt.format(statistics.median(values))
    return f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def print_table(columns: dict[str, list[dict[str, float]]]) -> None:
    """ROWS as a Markdown table, a column per side (its header: its runs' figures), each cell
    the median (range) of its runs. A figure a run could not give (None: e.g. no failure
    signal when the lost replica left between two steps) is left out of its cell; a row no
    side gives is left out."""
    print(f"| {'':48} | " + " | ".join(f"{h:>21}" for h in columns) + " |")
    print(f"| {'-' * 48} | " + " | ".join("-" * 21 for _ in columns) + " |")
    for label, key, fmt in ROWS:
        cells = [
            _cell([r[key] for r in runs if r.get(key) is not None], fmt)
            for runs in columns.values()
        ]
        if any(c != "-" for c in cells):
            print(f"| {label:48} | " + " | ".join(f"{c:>21}" for c in cells) + " |")


def run_side(side: str, cluster: Cluster, nodes: list[Any], where: str) -> dict[str, float]:
    extra: dict[str, float] = {}
    if side == "stock":
        run = run_stock(cluster, nodes, where)
    elif side == "ray_torchft":
        run = run_ray_torchft(cluster, nodes, where)
    elif side == "torchrun":
        run = run_torchrun_side(where)
    else:
        run, extra = run_ours(cluster, nodes, where, side)
    records, started, killed_at, added_at = run
    # The evidence behind the figures, kept for a second look.
    Path(where).mkdir(parents=True, exist_ok=True)
    Path(where, "records.json").write_text(
        json.dumps(
            {
                "started": started,
                "killed_at": killed_at,
                "added_at": added_at,
                "records": [dataclasses.astuple(r) for r in records],
            }
        )
    )
    figures = summarize(records, started, killed_at, added_at, STEPS, BATCH)
    if "reported_redone" in extra:
        # In place, a step thrown away leaves no record (the job reports committed steps
        # only); the job counts it itself.
        figures["steps_redone"] = extra["reported_redone"]
    return figures | extra | {"grew": float("grow_s" in figures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side (>= 3)")
    parser.add_argument("--sides", default=",".join(SIDES), help="a comma-separated subset")
    parser.add_argument(
        "--plot",
        default="docs/img/recovery.png",
        help="the PNG of the runs' steps around the kill ('' for none)",
    )
    args = parser.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; choose from {SIDES}")
    keep_ray_on_loopback()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "_system_config": FAST_FAILURE_DETECTION},
    )
    nodes: list[Any] = []
    fresh_nodes(cluster, nodes)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    work = tempfile.mkdtemp(prefix="etrain-bench-")
    print(f"each run's step records: {work}/<side>-<repetition>/records.json", flush=True)
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    record_files: dict[str, list[Path]] = {side: [] for side in sides}
    for rep in range(args.repeat):
        # Each side takes each place in the order in turn.
        shift = rep % len(sides)
        for side in sides[shift:] + sides[:shift]:
            where = os.path.join(work, f"{side}-{rep}")
            run = run_side(side, cluster, nodes, where)
            results[side].append(run)
            record_files[side].append(Path(where, "records.json"))
            print(f"repetition {rep + 1}, {side}: {run}", flush=True)
            fresh_nodes(cluster, nodes)

    print()
    print(f"median (range) of {args.repeat} runs per side, sides rotated")
    print()
    print_table({HEADERS[side]: results[side] for side in sides})
    ray.shutdown()
    cluster.shutdown()
    if args.plot:
        # Imported here: matplotlib is only needed for the picture.
        from bench.recovery_plot import plot

        plot(record_files, Path(args.plot))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
