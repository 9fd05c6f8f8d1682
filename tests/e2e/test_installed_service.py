"""The service as the container image installs it and as `make run` starts it.

The project is built from exactly the paths helm/Dockerfile copies into its build stage,
the dashboard directory among them laid out the way the Dockerfile's node stage makes it
(its `npm ci` run for real), and installed (not editable) into a fresh virtual environment:
the wheel's build hook (setup.py) puts the dashboard into the package, as in the image, which
sets no ETRAIN_DASHBOARD_DIR. `etrain serve` then starts on the embedded default (no
ETRAIN_RAY_ADDRESS: a local Ray instance and SQLite), from a directory that holds no source,
and must serve the dashboard from the installed package, run the README's job to
`succeeded`, and keep every socket of its process tree, Ray's included, on loopback.

The fresh environment gets its third-party packages (torch, Ray, ...) from this test run's
own environment through a path file, so nothing is downloaded; the project itself is the
only thing installed there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from elastic.job_state import TERMINAL_STATES
from tests.conftest import TOKEN, all_events, free_port, small_job, wait_for
from tests.e2e.test_image_recipe import ROOT, copy_sources, stages
from tests.processes import named, process_tree, ready_to_train


def _stage(name: str) -> list[tuple[str, str]]:
    for stage in stages():
        word, rest = stage[0]
        assert word == "FROM"
        if rest.split()[-1] == name and " AS " in f" {rest.upper()} ":
            return stage
    raise AssertionError(f"helm/Dockerfile has no stage named {name}")


def _lay_out(stage: list[tuple[str, str]], context: Path, workdir: Path) -> None:
    """Carry out a stage's COPY instructions from the build context into ``workdir``, and its
    `npm ci` as it is written."""
    for word, rest in stage:
        if word == "COPY":
            sources = copy_sources(rest)
            assert sources is not None, "this stage copies only from the build context"
            dest = shlex.split(rest)[-1]
            for source in sources:
                src = context / source
                if dest in (".", "./") or dest.endswith("/"):
                    target = workdir / dest / Path(source).name
                else:
                    target = workdir / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(src, target)
                else:
                    shutil.copy2(src, target)
        elif word == "RUN" and rest.startswith("npm "):
            subprocess.run(shlex.split(rest), cwd=workdir, check=True, capture_output=True)


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in stages()[-1]:
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


# Libraries that Ray's serialization add-ons load into every worker process, and that the
# embedded cluster's worker set-up hook keeps out (elastic/process_setup.py).
ADD_ON_LIBRARIES = ("pydantic_core", "libarrow")


def _supervisor_libraries(root_pid: int) -> dict[int, set[str]]:
    """Of the supervisors' processes under ``root_pid``: pid -> the add-on libraries
    mapped into it."""
    found: dict[int, set[str]] = {}
    for pid in process_tree(root_pid):
        try:
            if not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::Supervisor"):
                continue
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found[pid] = {name for name in ADD_ON_LIBRARIES if name in maps}
    return found


def _listening_addresses(root_pid: int) -> set[str]:
    """host:port of every listening TCP socket held by ``root_pid`` or its descendants."""
    inodes: set[str] = set()
    for pid in process_tree(root_pid):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found: set[str] = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            assert len(hex_ip) == width
            raw = bytes.fromhex(hex_ip)
            if width == 8:
                host = ".".join(str(b) for b in reversed(raw))
            else:  # four little-endian 32-bit words
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                host = b"".join(words).hex()
            found.add(f"{host}:{int(hex_port, 16)}")
    return found


LOOPBACK = ("127.", "0000000000000000000000000000000" + "1", "00000000000000000000ffff7f")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the project as the image's build stage installs it."""
    base = tmp_path_factory.mktemp("image")
    context = base / "build-context"
    context.mkdir()
    build = _stage("build")
    for word, rest in build:
        if word != "COPY":
            continue
        sources = copy_sources(rest)
        if sources is None:
            # The node stage's directory, made as that stage makes it.
            assert shlex.split(rest) == ["--from=dashboard", "/dashboards", "./dashboards"], rest
            (context / "dashboards").mkdir()
            _lay_out(_stage("dashboard"), ROOT, context / "dashboards")
            continue
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(
                    src, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                )
            else:
                shutil.copy2(src, context / source)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # Third-party packages from this run's environment; not its .pth files (which would put
    # the editable checkout back on the path).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            str(context),
        ],
        check=True,
        cwd=base,
    )
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import service, elastic; print(service.__file__)"],
        cwd=base,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert where.startswith(str(site)), f"service imported from {where}, not the install"
    return base


class Service:
    """`etrain serve` of the installed project, on the embedded default; it can be killed
    and started again on the same data directory, as a reboot or an upgrade would."""

    def __init__(
        self, installed: Path, data_name: str = "data", settings: dict[str, str] | None = None
    ) -> None:
        self.installed = installed
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = installed / data_name
        data.mkdir(exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ETRAIN_", "RAY_"))}
        self.env.update(
            {
                "ETRAIN_PORT": str(self.port),
                "ETRAIN_DATA_DIR": str(data),
                "ETRAIN_API_TOKEN": TOKEN,
                "ETRAIN_RAY_NUM_CPUS": "2",
                "ETRAIN_RAY_DASHBOARD_PORT": str(free_port()),
                "ETRAIN_EVENT_POLL_INTERVAL_S": "0.2",
                "ETRAIN_LOG_LEVEL": "warning",
                **(settings or {}),
            }
        )
        self.log = installed / f"serve-{data_name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                [str(self.installed / "venv" / "bin" / "etrain"), "serve"],
                cwd=self.installed,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.proc = proc

        def ready() -> bool:
            assert proc.poll() is None, self.log.read_text()[-3000:]
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=180, interval=0.5, what="etrain serve to be ready")
        return proc

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def service(installed: Path) -> Iterator[Service]:
    # The image's service finds the dashboard in its package, as this one must.
    assert "ETRAIN_DASHBOARD_DIR" not in _image_env()
    served = Service(installed)
    try:
        served.start()
        yield served
    finally:
        served.stop()


def test_the_installed_service_serves_the_dashboard(service: Service) -> None:
    url = service.url
    page = httpx.get(f"{url}/")
    assert page.status_code == 200, page.text[:500]
    assert '<script type="module" src="ui/js/main.js">' in page.text
    site = next((service.installed / "venv" / "lib").glob("python3*/site-packages"))
    packaged = site / "service" / "dashboard_files" / "app" / "index.html"
    assert page.text == packaged.read_text()
    assert httpx.get(f"{url}/ui/js/main.js").status_code == 200
    library = httpx.get(f"{url}/ui/vendor/uplot/uPlot.esm.js")
    assert library.status_code == 200 and "export" in library.text
    assert httpx.get(f"{url}/ui/vendor/uplot/uPlot.min.css").status_code == 200


def test_the_readme_job_succeeds_on_the_embedded_default_on_loopback_only(
    service: Service,
) -> None:
    url = service.url
    proc = service.proc
    assert proc is not None
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    readme = (ROOT / "README.md").read_text()
    start = readme.index('{"name": "demo"')
    spec = json.loads(readme[start : readme.index("```", start)])
    assert spec == small_job()
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    try:
        deadline = time.monotonic() + 240
        seen: set[str] = set()
        supervisors: dict[int, set[str]] = {}
        while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in TERMINAL_STATES:
            # While the job trains, its workers are in the process tree too.
            seen |= _listening_addresses(proc.pid)
            if job["state"] == "running":
                supervisors.update(_supervisor_libraries(proc.pid))
            assert time.monotonic() < deadline, job
            time.sleep(1)
        assert job["state"] == "succeeded", job
        assert job["step"] == 50
    finally:
        if api.get(f"/v1/jobs/{job_id}").json()["state"] not in TERMINAL_STATES:
            api.post(f"/v1/jobs/{job_id}/cancel")
    seen |= _listening_addresses(proc.pid)
    assert seen, "found no listening sockets at all: the check would prove nothing"
    exposed = sorted(a for a in seen if not a.startswith(LOOPBACK))
    assert exposed == [], f"listening beyond loopback: {exposed}"
    # The job's supervisor, the head's cost of a running job, ran without the libraries
    # Ray's serialization add-ons load (a third of its memory).
    assert len(supervisors) == 1, supervisors
    assert list(supervisors.values()) == [set()], supervisors


def _wait_for_pool(root_pid: int, size: int, timeout_s: float = 90.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while len(ready := ready_to_train(process_tree(root_pid))) != size:
        assert time.monotonic() < deadline, f"the pool holds {sorted(ready)}, not {size}"
        time.sleep(0.5)
    return ready


def test_a_jobs_workers_start_in_the_nodes_ready_processes_which_are_never_reused(
    installed: Path,
) -> None:
    ready = Service(installed, "data-ready", {"ETRAIN_WARM_PROCESSES_PER_NODE": "2"})
    try:
        _check_ready_processes(ready.start(), ready.url)
    finally:
        ready.stop()


def _check_ready_processes(proc: subprocess.Popen[bytes], url: str) -> None:
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    # The node (2 CPUs) keeps 2 processes ready, torch imported.
    pool = _wait_for_pool(proc.pid, 2)
    idle = named(process_tree(proc.pid), b"ray::IDLE")
    r = api.post("/v1/jobs", json=small_job())
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    replicas: set[int] = set()
    supervisors: set[int] = set()
    deadline = time.monotonic() + 240
    while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in TERMINAL_STATES:
        tree = process_tree(proc.pid)
        replicas |= named(tree, b"ray::Replica")
        supervisors |= named(tree, b"ray::Supervisor")
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["state"] == "succeeded", job
    # Its two workers ran in the two processes that were ready before it was submitted, and
    # its supervisor in one of the idle processes the head node keeps for supervisors.
    assert replicas == pool
    assert len(supervisors) == 1 and supervisors <= idle - pool, (supervisors, idle)
    # Each was replaced: the pool is back to 2, all new processes; the used ones are gone.
    refilled = _wait_for_pool(proc.pid, 2)
    assert refilled.isdisjoint(pool)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pool)


# Ray's per-node agents notice their raylet is gone only after about a minute; they hold
# no job state and train nothing.
SLOW_TO_EXIT = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _session_processes(sid: int) -> list[str]:
    """Command lines of the processes still in the session ``sid`` (the killed service's,
    with its Ray), Ray's slow-exiting agents left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) != sid:
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                continue
            if not cmdline.startswith(SLOW_TO_EXIT):
                found.append(cmdline)
    return found


def _kill_and_restart(service: Service) -> None:
    """SIGKILL the service mid-job and start it again on the same data."""
    old = service.proc
    assert old is not None
    old.send_signal(signal.SIGKILL)
    old.wait()
    # Nothing of the old instance trains on: Ray's processes share the service's fate.
    wait_for(
        lambda: not _session_processes(old.pid),
        timeout=60,
        what=f"the killed service's Ray processes to end: {_session_processes(old.pid)}",
    )
    service.start()


def _ended(api: httpx.Client, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = wait_for(
        lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["state"] in TERMINAL_STATES and j,
        timeout=300,
        interval=1,
        what="the job to end after the restart",
    )
    return job


SURVIVOR_STEPS = 900
FRESH_STEPS = 600


def test_jobs_survive_a_sigkill_of_the_embedded_service(service: Service) -> None:
    """The embedded Ray ends with the service. Two jobs run when it is killed: one resumes
    from its latest checkpoint when the service comes back, and its steps end at max_steps;
    the other had saved none: the new supervisor says so and it trains again from step 0,
    its steps after the restart 1..max_steps, each once. (One kill for both: each start of
    the service starts a Ray.)"""
    api = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {TOKEN}"})
    one_worker = {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1}
    # Steps take ~30 ms here; the two jobs' starts can be seconds apart on a loaded machine,
    # so each has enough steps left to still be training when the other is where the kill
    # needs it.
    survivor = small_job(max_steps=SURVIVOR_STEPS) | {"name": "survivor", "scaling": one_worker}
    fresh = small_job(max_steps=FRESH_STEPS) | {"name": "no-checkpoint", "scaling": one_worker}
    fresh["checkpoint"] = {"every_steps": 100_000, "keep": 1}
    survivor_id = api.post("/v1/jobs", json=survivor).json()["id"]
    fresh_id = api.post("/v1/jobs", json=fresh).json()["id"]

    def both_ready() -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        jobs = [api.get(f"/v1/jobs/{i}").json() for i in (survivor_id, fresh_id)]
        ended = [j for j in jobs if j["state"] in TERMINAL_STATES]
        assert not ended, f"a job ended before the kill: {ended}"
        saved = api.get(f"/v1/jobs/{survivor_id}/checkpoints").json()["items"]
        return (saved, jobs[1]) if saved and jobs[1]["step"] > 0 else None

    checkpoint, reached = wait_for(
        both_ready, timeout=180, what="a first checkpoint and the other job's first steps"
    )
    assert reached["state"] == "running"
    assert api.get(f"/v1/jobs/{survivor_id}").json()["state"] == "running"
    _kill_and_restart(service)

    job = _ended(api, survivor_id)
    assert (job["state"], job["step"], job["total_steps"]) == (
        "succeeded",
        SURVIVOR_STEPS,
        SURVIVOR_STEPS,
    )
    events = all_events(api, survivor_id)
    kinds = [e["kind"] for e in events]
    assert "supervisor_recreated" in kinds, kinds
    last_restore = len(kinds) - 1 - kinds[::-1].index("restored")
    resumed_at = events[last_restore]["data"]["checkpoint_step"]
    assert resumed_at >= checkpoint[0]["step"]
    # After the restore, each step is reported once, in order, up to max_steps.
    steps = [e["data"]["step"] for e in events[last_restore:] if e["kind"] == "metrics"]
    assert steps == sorted(set(steps)) and steps[0] > resumed_at and steps[-1] == SURVIVOR_STEPS

    job = _ended(api, fresh_id)
    assert (job["state"], job["step"], job["total_steps"]) == (
        "succeeded",
        FRESH_STEPS,
        FRESH_STEPS,
    )
    events = all_events(api, fresh_id)
    kinds = [e["kind"] for e in events]
    recreated = kinds.index("supervisor_recreated")
    assert events[recreated]["data"]["checkpoint_step"] is None
    said = [
        e["data"]["reason"]
        for e in events[recreated:]
        if e["kind"] == "state" and e["data"]["state"] == "recovering"
    ]
    assert len(said) == 1, said
    told = re.fullmatch(
        r"the job's supervisor was lost; a new one resumes it from step 0 "
        r"\(no checkpoint was saved; step (\d+) was reached\)",
        said[0],
    )
    assert told and int(told[1]) >= reached["step"], said
    assert "restored" not in kinds[recreated:]
    steps = [e["data"]["step"] for e in events[recreated:] if e["kind"] == "metrics"]
    assert steps == list(range(1, FRESH_STEPS + 1))


@pytest.mark.alone  # it bounds the shutdown's time
def test_a_sigterm_stops_the_service_and_its_embedded_ray_within_seconds(
    service: Service,
) -> None:
    """A graceful stop ends the process and the Ray it started (it took 16 s before
    `etrain serve` stopped that Ray itself: see jobs.launcher.disconnect)."""
    proc = service.proc
    assert proc is not None
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 0, service.log.read_text()[-2000:]
    assert took < 8, took
    wait_for(
        lambda: not _session_processes(proc.pid),
        timeout=10,
        what=f"the service's Ray processes to end: {_session_processes(proc.pid)}",
    )
