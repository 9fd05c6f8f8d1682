"""`etrain` as a user runs it: the venv's console script in a real subprocess (the progress
bar in a pseudo-terminal), against the real service on the session's Ray cluster."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest
import yaml

from tests.conftest import TOKEN, LiveServer, make_settings
from tests.integration.test_client import HOLD_AT, api_get, chatty_job, jobs_ended

ROOT = Path(__file__).resolve().parents[2]
ETRAIN = str(Path(sys.executable).parent / "etrain")
EXAMPLE = str(ROOT / "examples" / "job.yaml")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def live(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = make_settings(tmp_path_factory.mktemp("cli"), entrypoint_modules=["tests.workloads"])
    with LiveServer(settings) as server:
        yield server


def clean_env(config_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user with no ETRAIN_URL / ETRAIN_TOKEN of their own."""
    env = {k: v for k, v in os.environ.items() if k not in ("ETRAIN_URL", "ETRAIN_TOKEN")}
    return {**env, "XDG_CONFIG_HOME": str(config_home), "TERM": "xterm-256color", **extra}


@pytest.fixture(scope="module")
def env(live: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A user logged in to the live server (with the --token form)."""
    home = tmp_path_factory.mktemp("home")
    environment = clean_env(home)
    done = etrain(environment, "login", live.url, "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    return environment


def etrain(
    env: dict[str, str], *args: str, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ETRAIN, *args], env=env, input=stdin, capture_output=True, text=True, timeout=timeout
    )


def test_login_keeps_the_token_for_the_user_only(live: LiveServer, tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    saved = tmp_path / "etrain" / "config.json"

    refused = etrain(env, "login", live.url, stdin="not-the-token\n")
    assert refused.returncode == 1
    assert refused.stderr == (
        "error: the token is not valid (401 Unauthorized); "
        "run `etrain login URL` or set ETRAIN_TOKEN\n"
    )
    assert not saved.exists()
    assert etrain(env, "jobs").returncode == 1  # not logged in: no token is sent

    # In a terminal the token is asked for and not echoed.
    address = live.url.removeprefix("http://")
    child = pexpect.spawn(ETRAIN, ["login", address], env=env, encoding="utf-8", timeout=60)
    child.expect("Token: ")
    child.sendline(TOKEN)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert TOKEN not in (child.before or "")
    assert f"logged in to {live.url} as admin (admin); saved in {saved}" in (child.before or "")

    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
    assert json.loads(saved.read_text()) == {"url": live.url, "token": TOKEN}

    listed = etrain(env, "jobs", "--json")
    assert (listed.returncode, listed.stderr) == (0, "")
    assert isinstance(json.loads(listed.stdout), list)
    # ETRAIN_TOKEN overrides the saved token; ETRAIN_URL another server, which never gets it.
    assert etrain({**env, "ETRAIN_TOKEN": "wrong"}, "jobs").returncode == 1
    elsewhere = etrain({**env, "ETRAIN_URL": "http://127.0.0.1:9"}, "jobs")
    assert elsewhere.stderr == "error: could not reach http://127.0.0.1:9: connection refused\n"

    # Logging in from a script: the token on stdin.
    again = etrain(env, "login", live.url, stdin=TOKEN + "\n")
    assert again.returncode == 0, again.stderr


def test_submit_follow_draws_the_bar_to_succeeded(
    live: LiveServer, env: dict[str, str], tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    transcript = io.StringIO()
    with jobs_ended(live):
        # The README job, held after step HOLD_AT until the test opens its gate.
        child = pexpect.spawn(
            ETRAIN,
            [
                "submit",
                EXAMPLE,
                "--follow",
                "--name",
                "cli bar",
                "--set",
                "workload=tests.workloads.gated:train_loop",
                "--set",
                f"hyperparameters.gate={gate}",
                "--set",
                f"hyperparameters.hold_at_step={HOLD_AT}",
                "--set",
                "hyperparameters.learning_rate=0.02",
            ],
            env=env,
            encoding="utf-8",
            dimensions=(24, 160),
            timeout=240,
        )
        child.logfile_read = transcript
        child.expect(r"(job-[0-9a-f]+)\r\n")
        job_id = child.match.group(1)
        try:
            child.expect(rf"step {HOLD_AT}/50")  # the bar, part-way

            stored = api_get(live, f"/v1/jobs/{job_id}")
            assert stored["name"] == "cli bar"
            assert stored["workload"] == "tests.workloads.gated:train_loop"
            assert stored["spec"]["hyperparameters"]["learning_rate"] == 0.02
            assert stored["spec"]["hyperparameters"]["hold_at_step"] == HOLD_AT
            assert stored["spec"]["scaling"] == {
                "min_workers": 1,
                "max_workers": 2,
                "cpus_per_worker": 1.0,
                "gpus_per_worker": 0,
                "memory_per_worker_gb": None,
            }

            running = etrain(env, "jobs", "--state", "running")
            assert running.returncode == 0, running.stderr
            header, *rows = running.stdout.splitlines()
            assert header.split() == ["ID", "NAME", "STATE", "STEP", "LOSS", "WORKERS", "AGE"]
            (row,) = [r for r in rows if r.startswith(job_id)]
            assert re.match(rf"{job_id} +cli bar +running +{HOLD_AT}/50 +[\d.]+ +2 +\d+[smhd]", row)

            followers = {
                what: subprocess.Popen(
                    [ETRAIN, what, job_id, "-f"], env=env, stdout=subprocess.PIPE, text=True
                )
                for what in ("events", "logs")
            }
            time.sleep(2)
            assert [p.poll() for p in followers.values()] == [None, None]  # still following
        finally:
            gate.touch()
        child.expect(pexpect.EOF)
        child.close()
    assert child.exitstatus == 0

    screen = ANSI.sub("", transcript.getvalue())
    steps = [int(s) for s in re.findall(r"step (\d+)/50", screen)]
    assert HOLD_AT in steps and steps[-1] == 50
    assert steps == sorted(steps)  # the bar only moves forward
    # Before the first step it says what the job waits for, not `step 0/?`.
    assert re.search(
        r"(queued|starting) +[━╸╺]+ waiting (in the queue|for the first step on 2 workers)",
        screen,
    )
    assert "/?" not in screen
    assert re.search(r"\d\d:\d\d:\d\d  state running on 2 workers\r\n", screen)
    assert re.search(r"\d\d:\d\d:\d\d  state succeeded\r\n", screen)
    assert screen.rstrip().splitlines()[-1] == f"{job_id} succeeded"

    events_out, _ = followers["events"].communicate(timeout=60)
    logs_out, _ = followers["logs"].communicate(timeout=60)
    assert followers["events"].returncode == followers["logs"].returncode == 0
    stored_events = api_get(live, f"/v1/jobs/{job_id}/events", limit=5000)["items"]
    followed = [int(line.split()[0]) for line in events_out.splitlines()]
    assert followed == [e["seq"] for e in stored_events]
    assert events_out.splitlines()[-1].endswith("state succeeded")
    assert logs_out == etrain(env, "logs", job_id).stdout

    status = etrain(env, "status", job_id)
    assert status.returncode == 0
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in status.stdout.splitlines())
    assert (fields["id"], fields["name"], fields["state"], fields["step"]) == (
        job_id,
        "cli bar",
        "succeeded",
        "50/50",
    )
    checkpoints = etrain(env, "checkpoints", job_id)
    assert [line.split()[0] for line in checkpoints.stdout.splitlines()] == [
        "STEP",
        "30",
        "40",
        "50",
    ]
    as_json = json.loads(etrain(env, "checkpoints", job_id, "--json").stdout)
    assert as_json == api_get(live, f"/v1/jobs/{job_id}/checkpoints")["items"]


def test_a_job_that_fails_ends_the_follow_with_status_1(
    live: LiveServer, env: dict[str, str], tmp_path: Path
) -> None:
    job_file = tmp_path / "fails.yaml"
    # chatty prints, then reads `steps` as a number: "many" makes the attempt raise.
    job_file.write_text(yaml.safe_dump(chatty_job(steps="many")))
    with jobs_ended(live):
        submit = subprocess.Popen(
            [ETRAIN, "submit", str(job_file), "--follow"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert submit.stdout is not None
        job_id = submit.stdout.readline().strip()
        assert job_id.startswith("job-"), submit.stderr.read() if submit.stderr else ""
        logs = subprocess.Popen(
            [ETRAIN, "logs", job_id, "-f"], env=env, stdout=subprocess.PIPE, text=True
        )
        out, err = submit.communicate(timeout=240)
        logs_out, _ = logs.communicate(timeout=60)
    assert submit.returncode == 1, err
    assert err == ""
    lines = out.splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d  state failed: .*many.*", lines[-2])
    assert lines[-1].startswith(f"{job_id} failed: ") and "many" in lines[-1]

    assert logs.returncode == 0
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank}" in logs_out.splitlines()
    rank_1 = etrain(env, "logs", job_id, "--rank", "1")
    expected = [line for line in logs_out.splitlines() if line.startswith("[rank 1] ")]
    assert rank_1.stdout.splitlines() == expected and expected

    status = etrain(env, "status", job_id)
    assert re.search(r"^state +failed$", status.stdout, re.M)
    assert re.search(r"^message +.*many", status.stdout, re.M)


def test_errors_are_one_line_and_an_exit_status(
    live: LiveServer, env: dict[str, str], tmp_path: Path
) -> None:
    before = len(api_get(live, "/v1/jobs")["items"])

    bad_value = etrain(env, "submit", EXAMPLE, "--set", "hyperparameters.learning_rate=fast")
    assert (bad_value.returncode, bad_value.stdout) == (2, "")
    assert bad_value.stderr == (
        "error: hyperparameters.learning_rate: Input should be a valid number, "
        "unable to parse string as a number\n"
    )
    no_value = etrain(env, "submit", EXAMPLE, "--set", "hyperparameters.learning_rate")
    assert no_value.returncode == 2
    assert no_value.stderr.startswith("error: 'hyperparameters.learning_rate': expected a dotted")
    # Refused by the service rather than by the local check: one line naming the field.
    too_big = etrain(env, "submit", EXAMPLE, "--set", "scaling={min_workers: 8, max_workers: 8}")
    assert too_big.returncode == 2
    assert too_big.stderr.startswith("error: scaling.min_workers: min_workers is 8 but ")
    assert too_big.stderr.count("\n") == 1
    assert len(api_get(live, "/v1/jobs")["items"]) == before  # none of them made a job

    missing = etrain(env, "status", "job-nope")
    assert (missing.returncode, missing.stderr) == (1, "error: no job 'job-nope' (404 Not found)\n")
    assert etrain(env, "submit", str(tmp_path / "none.yaml")).stderr == (
        f"error: {tmp_path / 'none.yaml'}: No such file or directory\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        gone = etrain({**env, "ETRAIN_URL": url}, "events", "job-x", "-f")
    assert (gone.returncode, gone.stderr) == (
        1,
        f"error: could not reach {url}: connection refused\n",
    )


def test_cancel_ends_a_job(live: LiveServer, env: dict[str, str], tmp_path: Path) -> None:
    with jobs_ended(live):
        submitted = etrain(
            env,
            "submit",
            EXAMPLE,
            "--set",
            "workload=tests.workloads.gated:train_loop",
            "--set",
            f"hyperparameters.gate={tmp_path / 'never'}",
            "--set",
            "hyperparameters.hold_at_step=1",
        )
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        cancelled = etrain(env, "cancel", job_id)
        assert (cancelled.returncode, cancelled.stdout) == (0, f"{job_id} cancelled\n")
        assert json.loads(etrain(env, "status", job_id, "--json").stdout)["state"] == "cancelled"
        again = etrain(env, "cancel", job_id)
        assert (again.returncode, again.stderr) == (
            1,
            "error: the job is cancelled (409 Job already ended)\n",
        )
        listed = etrain(env, "jobs", "--state", "cancelled").stdout
        assert job_id in listed


def test_a_users_own_directory_runs_with_one_command(env: dict[str, str], tmp_path: Path) -> None:
    """``etrain submit job.yaml --code .`` from the user's project: a torchrun script as it
    is, packed, uploaded and followed to its end."""
    project = tmp_path / "project"
    project.mkdir()
    script = ROOT / "tests" / "workloads" / "torchrun_script" / "train.py"
    (project / "train.py").write_bytes(script.read_bytes())
    (project / "notes.tmp").write_text("left out")
    (project / ".etrainignore").write_text("*.tmp\n")
    (project / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "my-script",
                "command": ["python", "train.py", "--steps", "12"],
                "scaling": {"min_workers": 1, "max_workers": 2},
            }
        )
    )
    done = subprocess.run(
        [ETRAIN, "submit", "job.yaml", "--code", ".", "--follow"],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(
        r"^code: 3 files, [\d.]+ KiB packed \(id [0-9a-f]{12}\)$", done.stdout, re.M
    ), done.stdout
    assert "succeeded" in done.stdout
