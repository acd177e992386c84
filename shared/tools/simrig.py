"""How to run a service against its simulator, each in its own process: what the conformance suite
(tests/conformance/) needs to know of a service, and nothing else.

Every registered service has one, in the module `rig` beside its API (`services.<name>.rig:RIG`): the suite
finds it through the registry, so a new service is held to the same fault script as soon as it is registered
and has a rig (the suite fails for a registered service without one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.tools.localbroker import free_port


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
