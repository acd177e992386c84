"""A network namespace with a veth pair for the virtual hand: both ends live in the namespace, so
test traffic never touches the host's interfaces. The virtual hand answers on one end; the master
enters the namespace (`transport.netns.enter_netns`, a per-thread setns) before pysoem opens the other end. Only
the cycle process enters it, so the MQTT side keeps the host's loopback and broker.

    python -m services.ethercat_loop.sim.netns up [--name robobus-ec] [--protocol 0220]   # prints the master NIC
    python -m services.ethercat_loop.sim.netns down [--name robobus-ec]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from services.ethercat_loop.sim.virtual_hand import HandControl
from services.ethercat_loop.transport.netns import NetnsError

REPO = Path(__file__).resolve().parents[3]
RUN_DIR = Path("/run/robobus-ethercat")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


@dataclass
class VethNetns:
    """`name` namespace holding veth `master_if` <-> `hand_if`."""

    name: str
    master_if: str = ""
    hand_if: str = ""
    hand_proc: subprocess.Popen[bytes] | None = None
    control_path: str = ""
    hand_log: Path | None = None
    hand_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = self.name[-9:]  # interface names are limited to 15 characters
        self.master_if = self.master_if or f"ecm{tag}"
        self.hand_if = self.hand_if or f"ech{tag}"

    def up(self) -> None:
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.master_if, "netns", self.name, "type", "veth",
                "peer", "name", self.hand_if, "netns", self.name)
            for ifname in ("lo", self.master_if, self.hand_if):
                _ip("-n", self.name, "link", "set", ifname, "up")
            # no IPv6 router solicitations or MLD reports on the EtherCAT link
            subprocess.run(["ip", "netns", "exec", self.name, "sysctl", "-qw",
                            "net.ipv6.conf.all.disable_ipv6=1"], capture_output=True)
        except Exception:
            self.down()
            raise

    def start_hand(self, protocol: str = "0220", extra: list[str] | None = None, control_path: str | None = None,
                   log: Path | None = None, timeout: float = 15.0) -> HandControl:
        """Start the virtual hand on `hand_if` inside the namespace and wait until it answers."""
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.control_path = control_path or str(RUN_DIR / f"{self.name}.sock")
        self.hand_args = ["--iface", self.hand_if, "--protocol", protocol, "--control", self.control_path,
                          *(extra or [])]
        self.hand_log = log or RUN_DIR / f"{self.name}.log"
        out = open(self.hand_log, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.hand_proc = subprocess.Popen(
                ["ip", "netns", "exec", self.name, sys.executable, "-m", "services.ethercat_loop.sim.virtual_hand",
                 *self.hand_args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(REPO)})
        finally:
            out.close()
        ctl = HandControl(self.control_path)
        deadline = time.monotonic() + timeout
        while True:
            if self.hand_proc.poll() is not None:
                raise NetnsError(f"virtual hand exited ({self.hand_proc.returncode}): {self.log_text()[-2000:]}")
            try:
                ctl.call("stats")
                return ctl
            except OSError as exc:
                if time.monotonic() > deadline:
                    self.stop_hand()
                    msg = f"virtual hand did not answer within {timeout}s: {self.log_text()[-2000:]}"
                    raise NetnsError(msg) from exc
                time.sleep(0.05)

    def log_text(self) -> str:
        return self.hand_log.read_text(errors="replace") if self.hand_log and self.hand_log.exists() else ""

    def stop_hand(self) -> None:
        p = self.hand_proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.hand_proc = None

    def down(self, keep_log: bool = False) -> None:
        self.stop_hand()
        _ip("netns", "del", self.name, check=False)  # deleting the namespace deletes both veth ends
        for path in (self.control_path, "" if keep_log or self.hand_log is None else str(self.hand_log)):
            if path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


@contextlib.contextmanager
def virtual_hand_netns(protocol: str = "0220", extra: list[str] | None = None,
                       name: str | None = None) -> Iterator[tuple[VethNetns, HandControl]]:
    """Namespace + veth + running virtual hand, torn down whatever happens (tests, bench)."""
    ns = VethNetns(name or f"rbec{os.getpid()}")
    ns.up()
    try:
        ctl = ns.start_hand(protocol, extra)
        yield ns, ctl
    finally:
        ns.down()


def _pidfile(name: str) -> Path:
    return RUN_DIR / f"{name}.pid"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.ethercat_loop.sim.netns", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--name", default="robobus-ec")
    p.add_argument("--protocol", default="0220")
    p.add_argument("hand_args", nargs="*", help="extra virtual_hand options, after --")
    a, rest = p.parse_known_args(argv)  # options after `--` are the hand's
    a.hand_args = [*a.hand_args, *(x for x in rest if x != "--")]
    ns = VethNetns(a.name)
    if a.action == "down":
        pid = _pidfile(a.name)
        if pid.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pid.read_text()), signal.SIGTERM)
            pid.unlink()
        ns.control_path = str(RUN_DIR / f"{a.name}.sock")
        ns.down(keep_log=True)
        print(f"netns {a.name}: removed")
        return 0
    try:
        ns.up()
    except NetnsError as exc:  # e.g. it exists already: leave whatever is there alone
        print(f"netns {a.name}: {exc}", file=sys.stderr)
        return 1
    try:
        ns.start_hand(a.protocol, a.hand_args)
    except NetnsError as exc:
        print(f"netns {a.name}: {exc}", file=sys.stderr)
        ns.down(keep_log=True)
        return 1
    assert ns.hand_proc is not None
    _pidfile(a.name).write_text(str(ns.hand_proc.pid))
    print(f"netns {a.name}: virtual {a.protocol} hand on {ns.hand_if}; master NIC {ns.master_if}\n"
          f"  control socket {ns.control_path}, log {ns.hand_log}\n"
          f"  run the service with ROBOBUS_ETHERCAT_BACKEND=virtual ROBOBUS_ETHERCAT_IFNAME={ns.master_if} "
          f"ROBOBUS_ETHERCAT_NETNS={a.name}\n"
          f"  tear down: python -m services.ethercat_loop.sim.netns down --name {a.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
