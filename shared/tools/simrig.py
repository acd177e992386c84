"""How to run a service against its simulator, each in its own process: what the conformance suite
(tests/conformance/) needs to know of a service, and nothing else.

Every registered service has one, in the module `rig` beside its API (`services.<name>.rig:RIG`): the suite
finds it through the registry, so a new service is held to the same fault script as soon as it is registered
and has a rig (the suite fails for a registered service without one).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.tools.localbroker import REPO, free_port


class Ports:
    """Free loopback ports, allocated by name on first use and the same afterwards (a rig's simulator and its
    node agree on them; a restarted simulator gets the same address)."""

    def __init__(self) -> None:
        self._ports: dict[str, int] = {}

    def __getitem__(self, name: str) -> int:
        if name not in self._ports:
            self._ports[name] = free_port()
        return self._ports[name]


@dataclass(frozen=True)
class RigCommand:
    device: str
    name: str
    payload: dict[str, Any] = field(default_factory=dict)


Argv = Callable[[Ports], list[str]]


@dataclass(frozen=True)
class Footprint:
    """What one service may hold of `make run` idle (bench/footprint.py): its node process and the processes it
    starts, plus the simulators that serve it (`<x>-sim`, below). A rig may give its service a bound of its own
    (`SimRig.footprint`); every other service is held to the default."""

    node_mb: float = 45.0     # resident memory of the node process itself
    total_mb: float = 70.0    # resident memory of the node, its children and its simulators
    cpu_core: float = 0.04    # their CPU, idle, as a fraction of one core


DEFAULT_FOOTPRINT = Footprint()


def footprint_of(service_package: str) -> Footprint:
    """The bound a service's rig declares (`SimRig.footprint`), else the default; no rig: the default."""
    import importlib

    try:
        rig = importlib.import_module(f"{service_package}.rig").RIG
    except (ImportError, AttributeError):
        return DEFAULT_FOOTPRINT
    return getattr(rig, "footprint", None) or DEFAULT_FOOTPRINT


@dataclass(frozen=True)
class SimRig:
    """One service on its simulator, as separate processes (`python -m ...`)."""

    node_module: str                       # `python -m <node_module>` runs the node
    devices: tuple[str, ...]               # the devices node_env configures
    liveness_s: float                      # their liveness budget under node_env's settings
    sim: Argv                              # argv after `python`: the device side, on the real wire
    node_env: Callable[[Ports], dict[str, str]]
    return_s: float = 5.0                  # a returned device is operational within this (reconnect + budget)
    garbage_sim: Argv | None = None        # a device on the same address that sends only garbage
    wrong_kind_sim: Argv | None = None     # a device of another kind on the same address
    read_command: RigCommand | None = None  # must be answered (ok, or a stable error code) during every fault
    not_applicable: Mapping[str, str] = field(default_factory=dict)  # fault -> why the transport cannot tell
    needs: Callable[[], str | None] | None = None  # None, or why the rig cannot run on this machine
    footprint: Footprint | None = None     # its bound in `make run` idle (bench/footprint.py); None: the default
    # a service with a motion command that bench/stop.py does not measure: why (tests/kit/test_bench_stop.py fails
    # for one that it neither measures nor excuses here)
    stop_unmeasured: str | None = None


# -- `make run`'s Procfile on resources of one's own -------------------------------------------------------------
# deploy/Procfile.sim names every fixed resource of a line as a variable with its default, `${NAME:-default}`, so
# that a stack (the chaos runs, the footprint bench, the dashboard's tests) runs the same lines beside a `make run`
# by giving each variable a value of its own:
#   ROBOBUS_PORT_<PROCESS> (or a name ending in _PORT): a TCP port; `$((${NAME:-N}+k))` in a line uses the port
#       k above it, so the stack gives NAME the first of k + 1 consecutive free ports;
#   ROBOBUS_LINK_<PROCESS>: a file-system path (a serial link, a socket); the stack gives one in its own folder.
# Other variables are settings a stack may give (ROBOBUS_ROI_NETWORK, ROBOBUS_ETHERCAT_BACKEND, ...).
PROCFILE = REPO / "deploy" / "Procfile.sim"
_PROCFILE_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
_PROCFILE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}")
_PROCFILE_OFFSET = re.compile(r"\$\(\(\s*\$\{([A-Za-z_][A-Za-z0-9_]*):-[^}]*\}\s*\+\s*(\d+)\s*\)\)")


def procfile_commands(path: Path = PROCFILE) -> dict[str, str]:
    """process name -> its command line, for every line of the Procfile."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = _PROCFILE_LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def is_port_variable(name: str) -> bool:
    return name.startswith("ROBOBUS_PORT_") or name.endswith("_PORT")


def is_link_variable(name: str) -> bool:
    return name.startswith("ROBOBUS_LINK_")


@dataclass(frozen=True)
class ProcfileVariable:
    name: str
    default: str
    span: int = 1  # a port variable: how many consecutive ports from its value the lines use


def procfile_variables(commands: Iterable[str]) -> dict[str, ProcfileVariable]:
    """Every `${NAME:-default}` of the commands, with the span of consecutive ports a port variable covers."""
    found: dict[str, ProcfileVariable] = {}
    for command in commands:
        for m in _PROCFILE_VAR.finditer(command):
            name = m.group(1)
            span = max([found[name].span if name in found else 1,
                        *(int(o.group(2)) + 1 for o in _PROCFILE_OFFSET.finditer(command) if o.group(1) == name)])
            found[name] = ProcfileVariable(name, m.group(2), span)
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def consecutive_free_ports(n: int) -> list[int]:
    """n consecutive TCP ports nothing listens on (the first from free_port())."""
    for _ in range(200):
        base = free_port()
        ports = [base + i for i in range(n)]
        if all(_bindable(p) for p in ports[1:]):
            return ports
    raise RuntimeError(f"no {n} consecutive free ports")


def own_procfile_env(commands: Iterable[str], folder: Path) -> dict[str, str]:
    """The environment that moves every fixed port and link of the commands to one of the caller's own: a free
    port (run) for each port variable, a path in `folder` for each link variable."""
    env: dict[str, str] = {}
    for var in procfile_variables(commands).values():
        if is_port_variable(var.name):
            env[var.name] = str(consecutive_free_ports(var.span)[0])
        elif is_link_variable(var.name):
            env[var.name] = str(folder / var.name.removeprefix("ROBOBUS_LINK_").lower().replace("_", "-"))
    return env


def sim_serves(names: Iterable[str]) -> dict[str, str]:
    """simulator process -> the process it is the device side of, by the Procfile's naming: `<x>-sim` is the
    device side of the one other process named `<x>-...` (epuck-sim: epuck-gateway, roi-sim: roi-modules). A
    simulator without exactly one such process is an error: whose devices it serves would be unknown."""
    names = list(names)
    out: dict[str, str] = {}
    for sim in (n for n in names if n.endswith("-sim")):
        prefix = sim[: -len("sim")]
        served = [n for n in names if n.startswith(prefix) and n != sim]
        if len(served) != 1:
            raise ValueError(f"{sim}: {len(served)} processes named {prefix}... ({served}), not one: "
                             "name the simulator after the process it serves")
        out[sim] = served[0]
    return out


# -- generic misbehaving peers: `python -m shared.tools.simrig garbage-tcp --port P` -------------------------------
def _garbage_tcp(host: str, port: int, rate_hz: float) -> None:
    """Accepts every connection and answers with random bytes, forever: a device that speaks no protocol."""
    import os
    import socket
    import threading
    import time

    srv = socket.create_server((host, port), reuse_port=False)

    def serve(conn: socket.socket) -> None:
        conn.settimeout(1.0 / rate_hz)
        with conn:
            while True:
                try:
                    conn.recv(4096)
                except TimeoutError:
                    pass
                except OSError:
                    return
                try:
                    conn.sendall(os.urandom(64))
                except OSError:
                    return
                time.sleep(1.0 / rate_hz)

    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def _garbage_udp(host: str, port: int) -> None:
    """Answers every datagram with random bytes of a random length."""
    import os
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, port))
    while True:
        _, addr = s.recvfrom(65536)
        s.sendto(os.urandom(1 + os.urandom(1)[0] % 64), addr)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m shared.tools.simrig", description="generic misbehaving device peers")
    ap.add_argument("kind", choices=["garbage-tcp", "garbage-udp"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate-hz", type=float, default=50.0)
    a = ap.parse_args(argv)
    try:
        if a.kind == "garbage-tcp":
            _garbage_tcp(a.host, a.port, a.rate_hz)
        else:
            _garbage_udp(a.host, a.port)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
