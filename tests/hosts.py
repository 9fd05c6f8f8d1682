"""A Ray cluster whose nodes are hosts, for the tests of what real clusters do to a job.

Every other test runs Ray on loopback: one host name, one address, one network stack for all
nodes. Here each worker node is a host of its own, as a Kubernetes pod or a machine is:

- its own Linux network namespace, with an address of its own on a bridge (``10.78.N.0/24``,
  made by the test, with no route anywhere else), and loopback;
- its own UTS namespace: a host name the other nodes cannot resolve (as a pod's name in
  cluster DNS), and that resolves to 127.0.1.1 on the node itself (as Debian's hosts file
  has it);
- its own Ray temporary directory (sessions, sockets, logs), as on a separate machine.

The head (GCS and a raylet with no CPU, where the service places supervisors) runs in the
root network namespace on the bridge's address, with a host name of its own that resolves
to 127.0.1.1 there and to nothing on the nodes. The service (``etrain serve``) is a separate
process in the root namespace, connected to the head, as an operator would run it.

Where a Redis answers (``redis_namespace``), the head keeps its GCS's state there (Ray's GCS
fault tolerance) and ``kill_gcs`` SIGKILLs the GCS and gives what starts it again on the
head's host: the head's loss is a fault too.

Faults are injected per node: ``kill`` (SIGKILL of every process in the node's namespace),
``partition`` (both ways, or one way: the node hears its peers and they do not hear it; with
nftables in the node's namespace, packets dropped, never refused) and ``degrade`` (a share of
its packets dropped at random) healed by ``heal``, and ``freeze`` (every process SIGSTOPped)
ended by ``thaw``.
Processes are found by namespace, never by name: other Ray clusters on the machine (the
suite's pool, CI's) are never touched. Needs root, ``ip`` (iproute2) and ``unshare``;
:func:`unavailable` says why a machine cannot, and the tests skip with that reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import TOKEN, free_port, wait_for
from tests.gcs import GcsCommand, end_sessions, fault_tolerant_env, forget, kill_gcs, program_in
from tests.ray_head import served

RAY = str(Path(sys.executable).with_name("ray"))
NODE_START_TRIES = 3
# A driver that lists the nodes waits for the GCS with no bound of its own.
NODE_LIST_TIMEOUT_S = 60


def as_host(name: str, hosts_file: Path, own: tuple[Path, str] | None = None) -> list[str]:
    """The command prefix that runs a command as a host of its own: host name ``name``,
    ``hosts_file`` as its /etc/hosts and, with ``own``, a directory of its own mounted over
    a shared path (bind mounts in a private mount namespace)."""
    script = 'hostname "$1" && mount --bind "$2" /etc/hosts && '
    if own is not None:
        script += 'mount --bind "$3" "$4" && '
    script += f'shift {4 if own is not None else 2} && exec "$@"'
    binds = [str(own[0]), own[1]] if own is not None else []
    return [
        *("unshare", "--uts", "--mount", "--propagation", "private"),
        *("sh", "-c", script, "sh", name, str(hosts_file), *binds),
    ]


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def unavailable() -> str | None:
    """Why this machine cannot make hosts (None: it can)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    name = f"etprobe{os.getpid() % 100000}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if probe.returncode != 0:
        return f"network namespaces are not permitted: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


# How long a host's kill goes on killing what is left in its namespace.
KILL_ROUNDS_S = 10.0


def pids_in(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@dataclass
class Host:
    """One worker node: a Ray node in namespaces of its own."""

    index: int
    netns: str
    address: str
    hostname: str
    proc: subprocess.Popen[bytes] | None = None
    node_id: str | None = None

    def kill(self) -> float:
        """Every process of the node SIGKILLed at once (a machine lost); returns the time of
        the kill (``time.time()``). Killed again until none is left: a process forked while
        the others were listed (a raylet thawed a moment before starts a worker) would
        outlive the first round."""
        at = time.time()
        deadline = at + KILL_ROUNDS_S
        while (pids := pids_in(self.netns)) and time.time() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return at

    @property
    def alive(self) -> bool:
        return bool(pids_in(self.netns))

    def _nft(self, script: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "nft", "-f", "-"],
            input=script.encode(),
            check=True,
            capture_output=True,
        )

    def _drop(self, inbound: bool, share: str = "") -> float:
        """Packets leaving by the node's link dropped (``share``: an nftables condition that
        picks which), and with ``inbound`` those arriving too; ``heal`` ends it. Returns the
        time it took effect."""
        rules = [
            "add table inet etcut",
            "add chain inet etcut out { type filter hook output priority 0; policy accept; }",
            f'add rule inet etcut out oifname "eth0" {share}drop',
        ]
        if inbound:
            rules += [
                "add chain inet etcut in { type filter hook input priority 0; policy accept; }",
                f'add rule inet etcut in iifname "eth0" {share}drop',
            ]
        self._nft("\n".join(rules) + "\n")
        return time.time()

    def partition(self, one_way: bool = False) -> float:
        """Cut from every peer: nothing it sends leaves it and nothing sent to it arrives;
        ``one_way``: it still hears its peers, and they do not hear it. Packets are dropped,
        not refused (no reset: its peers' connections hang, as across a cut link). Returns
        the time the cut took effect."""
        return self._drop(inbound=not one_way)

    def degrade(self, percent: int) -> float:
        """``percent`` % of the node's packets dropped at random, each way (a flaky link or
        NIC: TCP's retransmits add latency spikes). Returns the time it took effect."""
        if not 0 < percent < 100:
            raise ValueError(f"a share of packets is 1-99 %, not {percent}")
        return self._drop(inbound=True, share=f"numgen random mod 100 < {percent} ")

    def heal(self) -> None:
        """The end of a partition or a degradation."""
        self._nft("delete table inet etcut\n")

    def freeze(self) -> float:
        """Every process of the node stopped (SIGSTOP): a machine that hangs, its sockets
        open. Returns the time of the stop."""
        for pid in pids_in(self.netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return time.time()

    def thaw(self) -> None:
        for pid in pids_in(self.netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@dataclass
class HostCluster:
    """A head on a bridge, and worker nodes that are hosts; see the module docstring."""

    work: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 100)
    hosts: list[Host] = field(default_factory=list)
    head_proc: subprocess.Popen[bytes] | None = None
    head_hostname: str = "etrain-head"
    port: int = 0
    temp: str = ""
    # With a Redis namespace, the head's GCS keeps its state in Redis (GCS fault tolerance)
    # and the head is started without --block (which would take the whole head down with
    # its GCS): its processes are found by their session.
    redis_namespace: str | None = None
    head_sessions: list[int] = field(default_factory=list)
    _gcs: GcsCommand | None = None
    _gcs_killed: bool = False

    @property
    def bridge(self) -> str:
        return f"etb{self.tag}"

    @property
    def head_address(self) -> str:
        return f"10.78.{self.subnet}.1"

    @property
    def address(self) -> str:
        """The GCS address, as ``ETRAIN_RAY_ADDRESS`` takes it."""
        return f"{self.head_address}:{self.port}"

    # -- the network --------------------------------------------------------------------

    def _hosts_file(self, name: str, own: str) -> Path:
        """A hosts file in which ``own`` (this host's name) is Debian's 127.0.1.1, and no
        other host's name is listed."""
        path = self.work / f"hosts-{name}"
        path.write_text(f"127.0.0.1 localhost\n127.0.1.1 {own}\n")
        return path

    def start(self, nodes: int) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.head_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self._start_head()
        for _ in range(nodes):
            self.add_node()

    def _start_head(self) -> None:
        # Ray's socket paths must stay short: a fresh directory right under /tmp.
        self.temp = tempfile.mkdtemp(prefix="ethost-", dir="/tmp")
        self.port = free_port()
        command = [
            RAY,
            "start",
            "--head",
            *([] if self.redis_namespace else ["--block"]),
            f"--port={self.port}",
            f"--node-ip-address={self.head_address}",
            "--num-cpus=0",
            "--include-dashboard=false",
            f"--temp-dir={self.temp}",
            f"--system-config={_fast_failure_detection()}",
        ]
        hosts = self._hosts_file("head", self.head_hostname)
        env = node_env()
        if self.redis_namespace:
            env |= fault_tolerant_env(self.redis_namespace)
        with (self.work / "head.log").open("wb") as log:
            self.head_proc = subprocess.Popen(
                [*as_host(self.head_hostname, hosts), *command],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.head_sessions = [self.head_proc.pid]
        probe = [sys.executable, "-c", f"import ray; ray.init(address='{self.address}')"]
        wait_for(
            lambda: (
                self._head_alive()
                and subprocess.run(probe, env=node_env(), capture_output=True).returncode == 0
            ),
            timeout=120,
            interval=1,
            what=f"the Ray head at {self.address} to accept a driver",
        )
        if self.redis_namespace:
            gcs = program_in(self.head_sessions, "gcs_server")
            assert gcs is not None
            self._gcs = GcsCommand.of(gcs)

    def _head_alive(self) -> bool:
        assert self.head_proc is not None
        returned = self.head_proc.poll()
        if self.redis_namespace:
            # `ray start` returns once the head runs; then the head is its raylet and its
            # GCS, which is started again when it died (its state is in Redis).
            dead = returned not in (None, 0) or (
                returned == 0
                and (program_in(self.head_sessions, "raylet") is None or not self._revive_gcs())
            )
        else:
            dead = returned is not None
        if dead:
            log = (self.work / "head.log").read_text()
            raise AssertionError(f"the Ray head has died:\n{log[-3000:]}")
        return True

    def _on_head(self) -> list[str]:
        """The command prefix that runs a command on the head's host (its host name and
        hosts file), as its raylet runs."""
        raylet = program_in(self.head_sessions, "raylet")
        assert raylet is not None, "the head has no raylet"
        return ["nsenter", f"--target={raylet}", "--uts", "--mount"]

    def kill_gcs(self) -> Callable[[], int]:
        """SIGKILL the head's GCS (its state is in Redis); returns what starts it again, as
        it was and on the head's host, giving its pid."""
        if not self.redis_namespace:
            raise RuntimeError("a head without GCS fault tolerance does not survive its GCS")
        self._gcs_killed = True
        start = kill_gcs(self.head_sessions, self._on_head())

        def start_again() -> int:
            self._gcs_killed = False
            return start()

        return start_again

    def _revive_gcs(self) -> bool:
        """A GCS that died of itself is started again, as a head pod's restart policy does
        with GCS fault tolerance, and said loudly (a partition healed after Ray declared the
        node dead was once seen to abort Ray's GCS: ``pure virtual method called``). False
        when it is down because a test killed it."""
        if program_in(self.head_sessions, "gcs_server") is not None:
            return True
        if self._gcs_killed or self._gcs is None:
            return False
        log = Path(self.temp) / "session_latest" / "logs" / "gcs_server.out"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        warnings.warn(
            f"the hosts bed's GCS died and is started again; its log ends:\n{tail}", stacklevel=2
        )
        self._gcs.start(self.head_sessions, self._on_head())
        return True

    def add_node(self, num_cpus: int = 1) -> Host:
        """A worker node in namespaces of its own, joined to the head."""
        index = len(self.hosts) + 1
        netns = f"et{self.tag}n{index}"
        veth = f"et{self.tag}v{index}"
        host = Host(index, netns, f"10.78.{self.subnet}.{10 + index}", f"etrain-node-{index}")
        _run("ip", "netns", "add", netns)
        self.hosts.append(host)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        hosts = self._hosts_file(host.hostname, host.hostname)
        command = [
            RAY,
            "start",
            "--block",
            f"--address={self.address}",
            f"--node-ip-address={host.address}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={150 * 1024 * 1024}",
        ]
        before = set(self.node_ids())
        # Ray gives a node's raylet 30 s (fixed) to register with the GCS; on a busy 2-core
        # machine (the rest of the suite beside) that was seen to run out: tried again.
        for attempt in range(1, NODE_START_TRIES + 1):
            own_dir = self.work / f"ray-{host.hostname}-{attempt}"
            own_dir.mkdir()
            log_path = self.work / f"{host.hostname}-{attempt}.log"
            with log_path.open("wb") as log:
                host.proc = subprocess.Popen(
                    # Ray's directory of its own over the head's: nodes take its path from
                    # the head.
                    [
                        *("ip", "netns", "exec", netns),
                        *as_host(host.hostname, hosts, (own_dir, self.temp)),
                        *command,
                    ],
                    env=node_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._joins(host, before, log_path, last=attempt == NODE_START_TRIES):
                return host
            host.kill()
            host.proc.wait()
            # A raylet that registered late is dropped by the GCS once its host is dead.
            wait_for(
                lambda: not set(self.node_ids()) - before,
                timeout=60,
                interval=1,
                what=f"{host.hostname}'s failed start to leave the cluster",
            )
        raise AssertionError("unreachable")

    def _joins(self, host: Host, before: set[str], log_path: Path, last: bool) -> bool:
        """Whether ``host``'s node joins the head (its ``ray start`` exiting is a failed
        start: an error on the last try)."""
        proc = host.proc
        assert proc is not None

        def joined() -> bool:
            if proc.poll() is not None:
                if last:
                    raise AssertionError(log_path.read_text()[-3000:])
                return True
            new = set(self.node_ids()) - before
            if new:
                (host.node_id,) = new
            return bool(new)

        wait_for(joined, timeout=120, interval=1, what=f"{host.hostname} to join the head")
        return proc.poll() is None

    def alive(self) -> list[Host]:
        return [h for h in self.hosts if h.alive]

    def restore(self, nodes: int) -> None:
        """Hosts added until ``nodes`` are alive, and Ray lists exactly those (a killed
        host's node is dropped by the GCS a few seconds after its death)."""
        while len(self.alive()) < nodes:
            self.add_node()
        wait_for(
            lambda: len(self.node_ids()) == nodes,
            timeout=60,
            interval=1,
            what=f"Ray to list {nodes} nodes besides the head",
        )

    def node_ids(self) -> list[str]:
        """The alive nodes other than the head, as the GCS lists them. A head that has died
        fails the caller at once, with its log's end (a driver would wait for it forever)."""
        self._head_alive()
        found = self._driver(
            "print('result:', json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']"
            f" and n['NodeManagerAddress'] != '{self.head_address}']))\n"
        )
        return [] if found is None else list(found)

    def kill_actor(self, name: str, namespace: str) -> bool:
        """The detached actor ``name`` of ``namespace`` killed; whether it was there."""
        found = self._driver(
            "try:\n"
            f"    ray.kill(ray.get_actor({name!r}, namespace={namespace!r}))\n"
            "    print('result: true')\n"
            "except ValueError:\n"
            "    print('result: false')\n"
        )
        return bool(found)

    def _driver(self, code: str) -> Any:
        """``code`` run by a driver of its own connected to the cluster (``ray`` and ``json``
        imported); what it printed after ``result:`` as JSON, or None when it failed."""
        program = (
            f"import json, ray\nray.init(address='{self.address}', log_to_driver=False)\n{code}"
        )
        try:
            out = subprocess.run(
                [sys.executable, "-c", program],
                env=node_env(),
                capture_output=True,
                text=True,
                timeout=NODE_LIST_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return None
        # Ray may print lines of its own (a raylet's message from the driver's cluster).
        found = [line for line in out.stdout.splitlines() if line.startswith("result: ")]
        if out.returncode != 0 or not found:
            return None
        return json.loads(found[-1].removeprefix("result: "))

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        if self.head_proc is not None and self.head_proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.head_proc.pid, signal.SIGTERM)
            try:
                self.head_proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.head_proc.pid, signal.SIGKILL)
                self.head_proc.wait()
        if self.redis_namespace:
            end_sessions(self.head_sessions)
            forget(self.redis_namespace)
        for host in self.hosts:
            if host.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.proc.wait(timeout=10)
            subprocess.run(["ip", "netns", "delete", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        if self.temp:
            shutil.rmtree(self.temp, ignore_errors=True)


def bench_cluster(parser: argparse.ArgumentParser, prefix: str) -> tuple[Path, HostCluster]:
    """For a bench: exits saying why when this machine cannot make hosts; else a fresh work
    directory (with ``cluster/`` and ``service/``) and its cluster, not started."""
    why = unavailable()
    if why is not None:
        parser.exit(2, f"this machine cannot make hosts: {why}\n")
    work = Path(tempfile.mkdtemp(prefix=prefix))
    (work / "cluster").mkdir()
    (work / "service").mkdir()
    return work, HostCluster(work / "cluster")


def _fast_failure_detection() -> str:
    from jobs.launcher import FAST_FAILURE_DETECTION

    return json.dumps(FAST_FAILURE_DETECTION)


def node_env() -> dict[str, str]:
    """This process's environment without the test session's Ray or service settings (and
    without the loopback-only switch the suite's own cluster needs). Token authentication
    off: `ray start` turns it on by itself when ~/.ray/auth_token exists, which another test
    may leave behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETRAIN_", "RAY_"))}
    return env | {
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "RAY_AUTH_MODE": "disabled",
    }


@contextlib.contextmanager
def service(
    cluster: HostCluster, work: Path, settings: dict[str, str] | None = None
) -> Iterator[httpx.Client]:
    """``etrain serve`` on loopback, connected to ``cluster``, with ``settings`` besides the
    tests' own; yields a client of its API."""
    env = node_env() | {
        "ETRAIN_PORT": str(free_port()),
        "ETRAIN_DATA_DIR": str(work / "service"),
        "ETRAIN_CHECKPOINT_DIR": str(work / "checkpoints"),
        "ETRAIN_API_TOKEN": TOKEN,
        "ETRAIN_RAY_ADDRESS": cluster.address,
        "ETRAIN_EVENT_POLL_INTERVAL_S": "0.2",
        **(settings or {}),
    }
    with served(env, work / "serve.log") as api:
        yield api
