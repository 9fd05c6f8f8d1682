"""A job's code (a command, or a ``train_loop``) that tries to reach what is not its own,
and prints one JSON line (prefixed ``PROBE``) of what each try got: the isolation test reads
it from the job's log.

Arguments: files it must not read, a directory it must not write, a process it must not
signal, and a marker for the process it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def attempt(what: object) -> str:
    try:
        result = what() if callable(what) else what
    except Exception as e:  # what it got is the point
        return f"refused: {type(e).__name__}"
    return f"got: {str(result)[:80]!r}"


def main(args: list[str]) -> None:
    secrets, marker = args[0].split(","), args[3]
    no_write, pid = Path(args[1]), int(args[2])
    out: dict[str, object] = {"uid": os.getuid()}
    status = Path("/proc/self/status").read_text().splitlines()
    out["cap_eff"] = next(line.split()[1] for line in status if line.startswith("CapEff"))
    out["env"] = sorted(k for k in os.environ if k.startswith(("RAY", "ETRAIN_")))
    out["read"] = {path: attempt(lambda p=path: Path(p).read_text()) for path in secrets}
    out["list"] = {
        path: attempt(lambda p=path: os.listdir(p))
        for path in ["/tmp", "/root", os.path.dirname(secrets[0])]
    }
    out["write"] = attempt(lambda: (no_write / "planted").write_text("x"))
    own = Path(os.environ["ETRAIN_CHECKPOINT_DIR"]) / "mine"
    out["write_own"] = attempt(lambda: own.write_text("x"))
    out["signal"] = attempt(lambda: os.kill(pid, 0))

    def connect_to_ray() -> str:
        import ray

        ray.init(address="auto", log_to_driver=False)
        return str(ray.cluster_resources())

    out["ray"] = attempt(connect_to_ray)
    # Left behind on purpose: the job must not leave it running.
    subprocess.Popen(["sleep", marker], start_new_session=True)
    print("PROBE " + json.dumps(out, sort_keys=True), flush=True)


def train_loop(config: dict[str, object], ctx: object) -> None:
    """The same tries from a ``train_loop`` run with the ctx API (``probe.py:train_loop``)."""
    hyperparameters = config["hyperparameters"]
    assert isinstance(hyperparameters, dict)
    main([str(a) for a in hyperparameters["args"]])


if __name__ == "__main__":
    main(sys.argv[1:])
