"""A robobus compose project for the tests: its own name, secrets, free broker ports; up, wait, down.

Each project is what `make up` brings up (deploy/compose.sh with the host's overrides), isolated by
ROBOBUS_PROJECT so several can run side by side (the fleet test runs a centre and sites)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.registry import service_packages
from shared.settings import KitSettings
from tests.deploy.deployfiles import DEPLOY, REPO, host_broker_conf, make_secrets
from tests.deploy.mqttprobe import creds, start_host_broker
from tests.fixtures import free_port, mosquitto_bin

DOCKER = "/usr/bin/docker"


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, env={**os.environ, **(env or {})}, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        shown = " ".join(args[:8]) + (" ..." if len(args) > 8 else "")  # a fleet's make_secrets: 600 arguments
        raise RuntimeError(f"{shown} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def compose_services(path: Path = DEPLOY / "compose.yaml") -> dict[str, dict[str, Any]]:
    """compose.yaml's containers, as written (its anchors merged; no docker needed)."""
    return dict(yaml.safe_load(path.read_text())["services"])


def compose_nodes(path: Path = DEPLOY / "compose.yaml") -> dict[str, str]:
    """container -> the registered service whose node it runs: its command is `python3 -m <the service's package>`
    (a simulator's, `-m <package>.sim`, is none)."""
    by_package = {pkg: name for name, pkg in service_packages().items()}
    out: dict[str, str] = {}
    for container, spec in compose_services(path).items():
        command = spec.get("command") or []
        if isinstance(command, list) and "-m" in command[:-1]:
            service = by_package.get(command[command.index("-m") + 1])
            if service is not None:
                out[container] = service
    return out


def device_simulators(path: Path = DEPLOY / "compose.yaml") -> set[str]:
    """The containers that run a service's device simulator (`python3 -m <the service's package>.sim`): they speak
    the device's protocol, not MQTT, and have no healthcheck of their own."""
    packages = set(service_packages().values())
    out: set[str] = set()
    for container, spec in compose_services(path).items():
        command = spec.get("command") or []
        if isinstance(command, list) and "-m" in command[:-1]:
            module = str(command[command.index("-m") + 1])
            if module.endswith(".sim") and module.removesuffix(".sim") in packages:
                out.add(container)
    return out


def sim_profile(profiles: list[str] | None) -> bool:
    """A container of `make up`'s simulated system: profile `sim`, or a `sim-<name>` one compose.sh brings along."""
    return any(p == "sim" or p.startswith("sim-") for p in profiles or [])


def expected_nodes() -> list[str]:
    """The sim profile's MQTT nodes: every registered service that has a node container in the sim profiles (a
    service's node is named as the service)."""
    services = compose_services()
    return sorted({s for c, s in compose_nodes().items() if sim_profile(services[c].get("profiles"))})


@dataclass
class Stack:
    name: str
    secrets: Path
    profiles: str = "sim"
    root: str = "robobus"
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    ws_port: int = field(default_factory=free_port)
    tls_port: int = field(default_factory=free_port)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {"ROBOBUS_PROJECT": self.name, "ROBOBUS_SECRETS_DIR": str(self.secrets),
                "ROBOBUS_BROKER_PORT": str(self.port), "ROBOBUS_BROKER_WS_PORT": str(self.ws_port),
                "ROBOBUS_BROKER_TLS_PORT": str(self.tls_port),
                "ROBOBUS_TOPIC_ROOT": self.root, "COMPOSE_PROFILES": self.profiles,
                "ROBOBUS_HEALTHCHECK_INTERVAL": "2s", "ROBOBUS_COMPOSE_VERBOSE": "0", **self.extra_env}

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([str(DEPLOY / "compose.sh"), *args], self.env, timeout, check)

    def secrets_args(self) -> list[str]:
        return ["--dir", str(self.secrets), "--root", self.root]

    def make_secrets(self, *extra: str) -> None:
        run(["python3", str(DEPLOY / "make_secrets.py"), *self.secrets_args(), *extra])

    def build(self) -> None:
        t0 = time.monotonic()
        self.compose("build")
        self.timings["build_s"] = time.monotonic() - t0

    def up(self, *services: str, timeout: float = 300) -> None:
        t0 = time.monotonic()
        self.compose("up", "-d", "--wait", "--wait-timeout", str(int(timeout)), *services, timeout=timeout + 60)
        self.timings["up_to_healthy_s"] = time.monotonic() - t0

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "10", check=False, timeout=180)

    def containers(self) -> list[dict[str, object]]:
        out = self.compose("ps", "--all", "--format", "json").stdout.strip()
        if not out:
            return []
        # compose prints one JSON object per line (newer) or one array (older)
        return json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines()]

    def container_id(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def settings(self, user: str = "operator", **kw: object) -> KitSettings:
        u, p = creds(self.secrets, user)
        kw.setdefault("topic_root", self.root)
        return KitSettings(mqtt_url=f"mqtt://127.0.0.1:{self.port}", mqtt_username=u, mqtt_password=p,
                           **kw)  # type: ignore[arg-type]

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout


@contextmanager
def bridged_host_brokers(folder: Path) -> Iterator[tuple[int, Path, int, Path]]:
    """(centre port, centre secrets, site port, site secrets): two host mosquittos with the generated config (ACL,
    plugin), the site bridged to the centre with the generated bridge.conf (plain: the TLS bridge has its own
    test). Skips where mosquitto is not installed."""
    exe = mosquitto_bin()
    if exe is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    central, edge = folder / "central", folder / "edge"
    assert make_secrets.main(["--dir", str(central), "--central", "--site", "site-a=site-a/robobus"]) == 0
    cport, eport = free_port(), free_port()
    (central / "m.conf").write_text(host_broker_conf(central, cport))
    assert make_secrets.main(["--dir", str(edge), "--root", "site-a/robobus", "--site", "site-a", "--bridge-to",
                              f"127.0.0.1:{cport}", "--bridge-credentials", str(central / "bridge-site-a.env"),
                              "--bridge-plain"]) == 0
    (edge / "m.conf").write_text(host_broker_conf(edge, eport, (edge / "bridge.conf").read_text()))
    procs = [start_host_broker(exe, central / "m.conf", cport, central),
             start_host_broker(exe, edge / "m.conf", eport, edge)]
    try:
        yield cport, central, eport, edge
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(5)
            if proc.stdout:
                proc.stdout.close()
