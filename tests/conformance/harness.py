"""One service, its simulator and a private broker, each in its own process, watched from outside; and the
fault script every service is held to (tests/conformance/test_conformance.py, `make conformance`).

What is checked is what a subscriber sees: the retained health and status, with the local time each arrived,
and the replies to a read-only command during the faults."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from shared.registry import service_plugins
from shared.rpc import RpcClient
from shared.settings import KitSettings
from shared.tools.localbroker import REPO, Broker, free_port
from shared.tools.simrig import Ports, SimRig

STABLE_CODES = {"unavailable", "timeout", "device_error", "busy", "stopped"}
# process start-up (a Python interpreter and the kit) on a busy 2-core machine, on top of every deadline that
# counts from a process being started
STARTUP_S = 20.0


def rigs() -> dict[str, SimRig | str]:
    """service -> its rig, or why it has none; one per registered service (the registry is the list)."""
    out: dict[str, SimRig | str] = {}
    for plugin in service_plugins():
        name, pkg = plugin.name, plugin.module.rsplit(".", 1)[0]
        try:
            out[name] = importlib.import_module(f"{pkg}.rig").RIG
        except (ImportError, AttributeError) as exc:
            out[name] = f"no rig: {pkg}.rig:RIG ({exc})"
    return out


@dataclass
class Seen:
    lock: threading.Lock = field(default_factory=threading.Lock)
    health: dict[str, list[tuple[float, dict[str, Any]]]] = field(default_factory=dict)
    status: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


class Stack:
    """Broker + node + simulator of one service."""

    def __init__(self, service: str, rig: SimRig) -> None:
        self.service, self.rig = service, rig
        self.workdir = Path(tempfile.mkdtemp(prefix=f"robobus-conf-{service}-"))
        self.ports = Ports()
        self.broker = Broker(free_port(), self.workdir)
        self.root = "robobus"
        self.node_name = f"conf-{service}"
        self.env = {**os.environ, "ROBOBUS_MQTT_URL": self.broker.url, "ROBOBUS_TOPIC_ROOT": self.root,
                    "ROBOBUS_NODE": self.node_name, "ROBOBUS_HEALTH_INTERVAL_S": "1",
                    "PYTHONUNBUFFERED": "1", **rig.node_env(self.ports)}
        self.node: Proc | None = None
        self.sim: Proc | None = None
        self.seen = Seen()
        self.observer: RpcClient | None = None

    # -- processes ---------------------------------------------------------------------------------------
    def start_broker(self) -> None:
        self.broker.start()
        self.observer = RpcClient(KitSettings(mqtt_url=self.broker.url, topic_root=self.root), name="conformance")
        self.observer.connect()
        base = f"{self.root}/{self.node_name}"
        self.observer.session.subscribe(f"{base}/status", self._on_status, qos=1)
        self.observer.session.subscribe(f"{base}/+/health", self._on_health, qos=1)

    def start_node(self) -> None:
        self.node = Proc("node", ["-m", self.rig.node_module], self.env, self.workdir)

    def start_sim(self, argv: list[str] | None = None, name: str = "sim") -> None:
        self.sim = Proc(name, argv if argv is not None else self.rig.sim(self.ports), self.env, self.workdir)

    def stop_sim(self) -> None:
        if self.sim is not None:
            self.sim.kill()
            self.sim = None

    def close(self) -> None:
        for p in (self.node, self.sim):
            if p is not None:
                p.kill()
        if self.observer is not None:
            self.observer.close()
        self.broker.kill()

    # -- observation --------------------------------------------------------------------------------------
    def _on_status(self, msg: mqtt.MQTTMessage) -> None:
        with contextlib.suppress(ValueError), self.seen.lock:
            self.seen.status.append((time.monotonic(), json.loads(msg.payload) if msg.payload else {}))

    def _on_health(self, msg: mqtt.MQTTMessage) -> None:
        device = msg.topic.split("/")[-2]
        with contextlib.suppress(ValueError), self.seen.lock:
            self.seen.health.setdefault(device, []).append((time.monotonic(), json.loads(msg.payload)))

    def latest(self, device: str) -> dict[str, Any]:
        with self.seen.lock:
            h = self.seen.health.get(device)
            return dict(h[-1][1]) if h else {}

    def health_since(self, device: str, t0: float) -> list[tuple[float, dict[str, Any]]]:
        with self.seen.lock:
            return [(t, h) for t, h in self.seen.health.get(device, []) if t >= t0]

    def online(self) -> bool:
        with self.seen.lock:
            return bool(self.seen.status) and bool(self.seen.status[-1][1].get("online"))

    def wait(self, pred: Callable[[], bool], timeout: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if pred():
                return time.monotonic() - t0
            time.sleep(0.02)
        return None

    def all_devices(self, pred: Callable[[dict[str, Any]], bool]) -> bool:
        return all(pred(self.latest(d)) for d in self.rig.devices)

    def operational(self) -> bool:
        return self.all_devices(lambda h: bool(h.get("connection")) and not h.get("error"))

    def call_read(self, timeout: float = 10.0) -> tuple[bool, str, float]:
        """The rig's read-only command: (answered ok or with a stable code, what, seconds)."""
        cmd = self.rig.read_command
        if cmd is None or self.observer is None:
            return True, "no read command", 0.0
        t0 = time.monotonic()
        try:
            rep = self.observer.call(self.node_name, cmd.device, cmd.name, cmd.payload, timeout=timeout)
        except Exception as exc:
            return False, f"no reply: {exc}", time.monotonic() - t0
        dt = time.monotonic() - t0
        if rep.ok:
            return True, "ok", dt
        code = str((rep.error or {}).get("code", "?"))
        return code in STABLE_CODES, f"error {code}", dt


@dataclass
class Verdict:
    service: str
    fault: str
    seen: str          # the transition seen (or why not applicable)
    seconds: float | None
    ok: bool | None    # None: not applicable
    problems: list[str] = field(default_factory=list)

    def row(self) -> tuple[str, str, str, str, str]:
        t = "" if self.seconds is None else f"{self.seconds:.2f} s"
        v = "n/a" if self.ok is None else ("ok" if self.ok else "FAIL")
        return self.service, self.fault, self.seen, t, v


def table(verdicts: list[Verdict]) -> str:
    rows = [("service", "fault", "seen", "time", "verdict")] + [v.row() for v in verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for v in verdicts:
        for p in v.problems:
            lines.append(f"  {v.service} / {v.fault}: {p}")
    return "\n".join(lines)
