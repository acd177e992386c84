"""The whole simulated system under test: a private mosquitto and every process of `make run` (the same
deploy/Procfile.sim, so a new service's simulator and node are in the chaos and soak runs as soon as they are
in `make run`), each process killable and restartable, and an observer of the retained status and health.

Used by tests/chaos/ and by `python -m tests.chaos` (make chaos / make soak)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from shared.registry import service_names
from shared.rpc import RpcClient
from shared.settings import KitSettings
from shared.tools.localbroker import REPO, Broker, free_port
from shared.tools.simrig import PROCFILE, consecutive_free_ports, own_procfile_env, procfile_variables, sim_serves
from shared.tools.simrig import procfile_commands as simrig_procfile_commands

__all__ = ["PROCFILE", "SimStack", "consecutive_free_ports", "own_resources", "procfile_commands", "sim_serves",
           "sim_stack"]

# the harness runs its own broker; the banner only prints; the dashboard and the Foxglove bridge are servers on a
# fixed port for people's tools (tests/dashboard and tests/foxglove have their own stacks); Home Assistant discovery
# runs only on request; the Prometheus exporter is a server for Prometheus (tests/prometheus runs it beside a stack
# of its own)
NOT_PROCESSES = {"broker", "banner", "dashboard", "foxglove", "homeassistant", "prometheus"}


def procfile_commands(path: Path = PROCFILE) -> dict[str, str]:
    """name -> shell command, for every process of `make run` but the broker and the banner."""
    return {n: c for n, c in simrig_procfile_commands(path).items() if n not in NOT_PROCESSES}


# The ROI network: its ports are fixed by the protocol, so the stack takes a loopback /24 of its own
# (the Procfile's ${ROBOBUS_ROI_NETWORK:-127.0.2}).
ROI_PORTS = (57344, 57664)
ROI_OCTETS = (10, 20, 30, 100)  # the Procfile's modules and the node's host octet


def _bindable(host: str, port: int, kind: socket.SocketKind = socket.SOCK_STREAM) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_roi_network() -> str:
    """A loopback /24 whose ROI addresses and ports are free: 127.100-149.x, a range no other test uses."""
    for n in range(200):
        pid = os.getpid() + n * 7919
        prefix = f"127.{100 + pid % 50}.{(pid // 50) % 250 + 1}"
        if all(_bindable(f"{prefix}.{o}", port, socket.SOCK_DGRAM) for o in ROI_OCTETS for port in ROI_PORTS):
            return prefix
    raise RuntimeError("no free loopback network for the ROI simulator")


def own_resources(commands: dict[str, str], workdir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The Procfile's commands and the environment that gives them ports, links and a ROI network of this stack's
    own: every port and link variable of the lines (shared/tools/simrig.py, `own_procfile_env`), free when chosen,
    so that the stack runs beside a `make run` or another stack."""
    env = own_procfile_env(commands.values(), workdir)
    if "ROBOBUS_ROI_NETWORK" in procfile_variables(commands.values()):
        env["ROBOBUS_ROI_NETWORK"] = free_roi_network()
    return dict(commands), env


@dataclass
class Proc:
    """One process of the stack, started through bash so the Procfile's `${VAR:-default}` expand; the
    command is exec'd, so the pid is the service's own (for kill -9 and /proc sampling)."""

    name: str
    command: str
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    starts: int = 0

    def start(self, logdir: Path) -> None:
        self.log = logdir / f"{self.name}.log"
        out = self.log.open("ab")
        # `A=1 B=2 exec cmd`: bash keeps leading assignments in the exec'd command's environment
        cmd = re.sub(r"^((?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|\S+)\s+)*)", r"\1exec ", self.command)
        self.popen = subprocess.Popen(["bash", "-c", cmd], env=self.env, cwd=REPO, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        if self.popen and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.popen.returncode

    def tail(self, n: int = 20) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@dataclass
class Seen:
    """The latest retained status and health, with the local time each arrived."""

    status: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    health: dict[tuple[str, str], tuple[float, dict[str, Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def online_nodes(self) -> set[str]:
        with self.lock:
            return {n for n, (_, s) in self.status.items() if s.get("online")}

    def node_status(self, node: str) -> dict[str, Any]:
        with self.lock:
            return dict(self.status.get(node, (0.0, {}))[1])

    def device_health(self, node: str, device: str) -> dict[str, Any]:
        with self.lock:
            return dict(self.health.get((node, device), (0.0, {}))[1])

    def devices(self) -> list[tuple[str, str]]:
        with self.lock:
            return sorted(self.health)


class SimStack:
    """Broker + every `make run` process on simulators, on a free port, for chaos and soak runs."""

    def __init__(self, root: str = "robobus") -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="robobus-chaos-"))
        self.broker = Broker(free_port(), self.workdir)
        self.root = root
        commands, own_env = own_resources(procfile_commands(), self.workdir)
        env = {**os.environ, "ROBOBUS_MQTT_URL": self.broker.url, "ROBOBUS_TOPIC_ROOT": root,
               "PYTHONUNBUFFERED": "1", "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}:/usr/sbin",
               **own_env}
        self.procs = {n: Proc(n, c, env) for n, c in commands.items()}
        self.seen = Seen()
        self.observer: RpcClient | None = None
        self.expected_nodes: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, settle_s: float = 60.0) -> None:
        self.broker.start()
        for p in self.procs.values():
            p.start(self.workdir)
        self.observer = self.client("chaos-observer")
        self.observer.session.subscribe(f"{self.root}/+/status", self._on_status, qos=1)
        self.observer.session.subscribe(f"{self.root}/+/+/health", self._on_health, qos=1)
        # every registered service must bring a node online (what `robobus status --expect-all` checks)
        wanted = set(service_names())
        self.wait(lambda: wanted <= self.online_services(), settle_s, interval=0.2)
        time.sleep(1.0)  # health of devices that connect a little after their node
        self.expected_nodes = self.seen.online_nodes()

    def online_services(self) -> set[str]:
        with self.seen.lock:
            return {s.get("service", "") for _, s in self.seen.status.values() if s.get("online")}

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()
        if self.observer is not None:
            self.observer.close()
        self.broker.kill()

    def client(self, name: str) -> RpcClient:
        c = RpcClient(KitSettings(mqtt_url=self.broker.url, topic_root=self.root), name=name)
        c.connect()
        return c

    def devices_of(self, proc: Proc) -> set[tuple[str, str]]:
        """(node, device) of every device of the nodes `proc` serves."""
        nodes = {n for n, p in self.node_procs().items() if p is proc}
        return {k for k in self.seen.devices() if k[0] in nodes}

    def node_procs(self) -> dict[str, Proc]:
        """node name -> the process serving it (by the pid in its status)."""
        by_pid = {p.pid: p for p in self.procs.values()}
        out = {}
        for node in self.expected_nodes:
            pid = self.seen.node_status(node).get("pid")
            if pid in by_pid:
                out[node] = by_pid[pid]
        return out

    # -- observation ---------------------------------------------------------------------------------------
    def _on_status(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(self.root) + 1:].split("/")
        with contextlib.suppress(ValueError), self.seen.lock:
            self.seen.status[parts[0]] = (time.monotonic(), json.loads(msg.payload))

    def _on_health(self, msg: mqtt.MQTTMessage) -> None:
        parts = msg.topic[len(self.root) + 1:].split("/")
        with contextlib.suppress(ValueError), self.seen.lock:
            self.seen.health[(parts[0], parts[1])] = (time.monotonic(), json.loads(msg.payload))

    def wait(self, pred: Callable[[], bool], timeout: float, interval: float = 0.02) -> float | None:
        """Seconds until `pred()` held, or None if it did not within `timeout`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if pred():
                return time.monotonic() - t0
            time.sleep(interval)
        return None

    def all_online(self) -> bool:
        return self.expected_nodes <= self.seen.online_nodes()


@contextlib.contextmanager
def sim_stack(root: str = "robobus") -> Iterator[SimStack]:
    stack = SimStack(root)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


# -- process sampling (/proc: no dependency) ---------------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class ProcSample:
    t: float
    rss_kb: int
    threads: int
    cpu_s: float


def sample(pid: int) -> ProcSample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    fields = stat[stat.rindex(")") + 2:].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    return ProcSample(time.monotonic(), rss, threads, cpu)


def expand(command: str, env: dict[str, str]) -> list[str]:
    """The words bash makes of a Procfile command (its variables expanded with `env`, quotes removed): what a
    test reads to see the values a process is started with."""
    script = f"for w in {command}; do printf '%s\\0' \"$w\"; done"
    out = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                         check=True)
    return out.stdout.decode().split("\0")[:-1]
