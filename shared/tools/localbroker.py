"""A private mosquitto on a free loopback port, and service nodes in subprocesses: for the tests (through the
pytest plugin tests/fixtures.py), the benchmarks and local tools. No pytest here: this is importable anywhere."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.settings import KitSettings

REPO = Path(__file__).resolve().parents[2]


_PICK = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def free_port() -> int:
    """A TCP port nothing listens on, below the kernel's ephemeral range (ip_local_port_range). A port from
    that range, as `bind(0)` gives, may be handed to any client socket on the host between this choice and the
    bind of the process it is for (seen with several test processes side by side); a port below it is taken
    only by a listener, which the check here sees. Where the range leaves no room, the kernel chooses."""
    lo, _ = _ephemeral_range()
    if lo - 1 > 20000:
        for _ in range(200):
            port = _PICK.randrange(20000, lo)
            with socket.socket() as s:
                try:
                    s.bind(("", port))  # any address: also refused where a listener holds 127.0.0.1:port only
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The per-client limits of every broker the project ships (deploy/mosquitto/mosquitto.conf for `make run`,
# deploy/mosquitto/compose.conf for compose and a fleet; tests/deploy/test_broker_config.py checks they agree), so
# that a test floods the broker a user runs: in flight per client (and the Receive Maximum a client is given, the
# kit's own window), then queued per client, by count and by bytes; past them a QoS 1 message is dropped silently.
BUS_LIMITS: dict[str, int] = {
    "max_inflight_messages": 1000,
    "max_queued_messages": 100_000,
    "max_queued_bytes": 64 * 1024 * 1024,
}


def limits_conf() -> str:
    return "".join(f"{key} {value}\n" for key, value in BUS_LIMITS.items())


def mosquitto_bin() -> str | None:
    return shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)


@dataclass
class Broker:
    """A real mosquitto on 127.0.0.1:<port>; `restart()` kills it hard and starts it again. With make run's limits
    (BUS_LIMITS); without persistence unless asked (`autosave_interval` seconds, as make run's broker saves: then a
    restart keeps what was saved before the kill, in `workdir`/db)."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    log: list[str] = field(default_factory=list)
    persistence: bool = False
    autosave_interval: int = 1

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def db_dir(self) -> Path:
        return self.workdir / "db"

    def _persistence_conf(self) -> str:
        if not self.persistence:
            return "persistence false\n"
        self.db_dir.mkdir(exist_ok=True)
        # started as root mosquitto becomes the user mosquitto, who cannot enter a private temporary folder
        user = "user root\n" if is_root() else ""
        return (f"{user}persistence true\npersistence_location {self.db_dir}/\n"
                f"autosave_interval {self.autosave_interval}\nautosave_on_changes false\n")

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            "per_listener_settings false\nallow_anonymous true\n" + self._persistence_conf()
            + "set_tcp_nodelay true\n" + limits_conf() + f"listener {self.port} 127.0.0.1\n"
        )
        exe = mosquitto_bin()
        if not exe:
            raise RuntimeError("mosquitto is not installed (make test installs it)")
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.02)
        raise RuntimeError(f"mosquitto did not listen on {self.port}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self, down_s: float = 0.3) -> None:
        self.kill()
        time.sleep(down_s)
        self.start()

    def settings(self, **kw: Any) -> KitSettings:
        return KitSettings(mqtt_url=self.url, **kw)


class NodeProcess:
    """A service node in its own process (python -m ...), for kill -9, SIGTERM and isolation tests."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, *args], env=full_env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.decode(errors="replace").rstrip())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(2)
        return int(self.proc.returncode)

    def text(self) -> str:
        return "\n".join(self.output)


def is_root() -> bool:
    return os.geteuid() == 0


def can_netns() -> str | None:
    """None if network namespaces and veth pairs can be made here, else the reason."""
    if not is_root():
        return "needs root (network namespaces, raw sockets)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    name = f"rbprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None
