"""The fleet bench's centre: deploy/compose.cluster.yaml (three ejabberd nodes, fleet-watch, fleet-gate) as its own
compose project, and what it costs (each container's CPU and memory from its cgroup).

The sites are host processes, so the nodes' TLS listeners (8883) must be reachable from the host under a name
their certificate carries. The project's `wan` network is created here with a subnet of its own, and a compose
override written next to the secrets (not a file of the repository) gives each node a fixed address on it; the
centre's certificate carries those addresses (make_secrets --tls-name), so each site's bridge checks the node's
certificate against the address it dials, as a site checks a node's name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.deploy.stack import run as run  # noqa: E402  (the tests' command helper, as bench/deploy.py uses it)

DEPLOY = REPO / "deploy"
DOCKER = "/usr/bin/docker"
NODES = ("ejabberd1", "ejabberd2", "ejabberd3")
SERVICES = (*NODES, "fleet-watch", "fleet-gate")
CGROUP = Path("/sys/fs/cgroup")


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999): a port the kernel hands out for port 0 is free
    now, but another process's next connect or bind may take it before docker or a site's broker binds it (seen: a
    node's published port taken while the nodes before it started)."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def ensure_images(work: Path) -> None:
    """fleet-watch and fleet-gate run in the recorder image, which compose.cluster.yaml names but does not build
    (compose.yaml does): built here on a fresh clone (deploy/compose.sh, profile record), as `make up` would.
    The ejabberd image `up` builds itself."""
    image = f"robobus/recorder:{os.environ.get('ROBOBUS_VERSION', 'dev')}"
    if run([DOCKER, "image", "inspect", image], check=False).returncode == 0:
        return
    secrets = work / "build-secrets"
    run(["python3", str(DEPLOY / "make_secrets.py"), "--dir", str(secrets)])
    run([str(DEPLOY / "compose.sh"), "build", "recorder"], {"ROBOBUS_SECRETS_DIR": str(secrets),
        "COMPOSE_PROFILES": "record", "ROBOBUS_PROJECT": "robobus-fleet-build"}, timeout=1800)


@dataclass
class Usage:
    """One container's CPU time (ns, since it started) and resident memory (bytes) at one moment."""

    cpu_ns: int
    rss: int


def usage(container: str) -> Usage | None:
    """From the container's cgroup (v1, cgroupfs: docker/<id>; v2: system.slice/docker-<id>.scope)."""
    v1 = CGROUP / "cpuacct" / "docker" / container / "cpuacct.usage"
    if v1.exists():
        try:
            cpu = int(v1.read_text())
            stat = (CGROUP / "memory" / "docker" / container / "memory.stat").read_text()
        except OSError:
            return None
        rss = next((int(line.split()[1]) for line in stat.splitlines() if line.startswith("total_rss ")), 0)
        return Usage(cpu, rss)
    v2 = next((p for p in (CGROUP / "system.slice" / f"docker-{container}.scope", CGROUP / "docker" / container)
               if p.exists()), None)
    if v2 is None:
        return None
    try:
        cpu_us = next(int(line.split()[1]) for line in (v2 / "cpu.stat").read_text().splitlines()
                      if line.startswith("usage_usec"))
        anon = next((int(line.split()[1]) for line in (v2 / "memory.stat").read_text().splitlines()
                     if line.startswith("anon ")), 0)
    except (OSError, StopIteration):
        return None
    return Usage(cpu_us * 1000, anon)


@dataclass
class Centre:
    tag: str
    secrets: Path
    sites: dict[str, str]  # site -> topic root
    ports: dict[str, int] = field(default_factory=lambda: {n: free_port() for n in NODES})
    ips: dict[str, str] = field(default_factory=dict)
    subnet: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"robobus-fleet-{self.tag}"

    @property
    def wan(self) -> str:
        return f"robobus-fleetwan-{self.tag}"

    @property
    def override(self) -> Path:
        return self.secrets / "compose.fleet-bench.yaml"

    @property
    def env(self) -> dict[str, str]:
        return {"ROBOBUS_PROJECT": self.name, "ROBOBUS_SECRETS_DIR": str(self.secrets),
                "ROBOBUS_WAN_NETWORK": self.wan, "ROBOBUS_HEALTHCHECK_INTERVAL": "1s",
                "ROBOBUS_CENTRAL_SITES": " ".join(f"{s}={r}" for s, r in self.sites.items()),
                **{f"ROBOBUS_CLUSTER_PORT_{i + 1}": str(self.ports[n]) for i, n in enumerate(NODES)}}

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([DOCKER, "compose", "-f", str(DEPLOY / "compose.cluster.yaml"), "-f", str(self.override),
                    "--profile", "cluster", *args], self.env, timeout, check)

    def create_network(self) -> None:
        """The wan network on a /24 of its own (10.213-250.x.0/24: the first docker accepts)."""
        for k in range(400):
            pid = os.getpid() + k * 7919
            subnet = f"10.{213 + pid % 37}.{(pid // 37) % 250 + 1}"
            proc = run([DOCKER, "network", "create", "--subnet", f"{subnet}.0/24", self.wan], check=False)
            if proc.returncode == 0:
                self.subnet = subnet
                self.ips = {n: f"{subnet}.{11 + i}" for i, n in enumerate(NODES)}
                return
        raise RuntimeError("no free subnet for the fleet bench's wan network")

    def prepare(self) -> None:
        """The network, the centre's secrets for every site (users, ACL, certificate for the nodes' addresses),
        and the override that pins the nodes' addresses."""
        self.secrets.mkdir(parents=True, exist_ok=True)
        self.create_network()
        run(["python3", str(DEPLOY / "make_secrets.py"), "--dir", str(self.secrets), "--central", "--cluster",
             *[a for ip in self.ips.values() for a in ("--tls-name", ip)],
             *[a for s, r in self.sites.items() for a in ("--site", f"{s}={r}")]], timeout=300)
        services = {n: {"networks": {"wan": {"aliases": [n], "ipv4_address": ip}}} for n, ip in self.ips.items()}
        self.override.write_text(json.dumps({"services": services}, indent=1))  # YAML is a superset of JSON

    def addresses(self, first: int) -> str:
        """A site's bridge addresses: every node's TLS listener, node `first` first, then the others in turn."""
        order = NODES[first % 3:] + NODES[:first % 3]
        return ",".join(f"{self.ips[n]}:8883" for n in order)

    def up(self, timeout: float = 900) -> float:
        t0 = time.monotonic()
        self.compose("up", "-d", "--wait", "--wait-timeout", str(int(timeout)), timeout=timeout + 120)
        took = time.monotonic() - t0
        self.timings.setdefault("up_s", took)
        return took

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300)
        run([DOCKER, "network", "rm", self.wan], check=False)

    def container(self, service: str) -> str:
        out = self.compose("ps", "-q", "--all", service).stdout.strip()
        full = run([DOCKER, "inspect", "--format", "{{.Id}}", out], check=False).stdout.strip() if out else ""
        return full

    def log_lines(self, service: str, having: str, last: int = 15) -> list[str]:
        """The last `last` lines of a centre container's log that hold `having` (a site's user: what its node
        made of it), for a bench's record of a fault it did not expect."""
        r = self.compose("logs", "--no-color", "--no-log-prefix", service, timeout=60, check=False)
        return [ln for ln in (r.stdout + r.stderr).splitlines() if having in ln][-last:]

    def containers(self) -> dict[str, str]:
        return {s: self.container(s) for s in SERVICES}

    def usage(self, containers: dict[str, str]) -> dict[str, Usage | None]:
        return {s: usage(c) if c else None for s, c in containers.items()}
