"""The virtual hand on a veth pair of its own, for exactly as long as it runs (root).

The master's end (`--master-if`) is made in the caller's network namespace, the hand's end in a namespace that
only the hand's process holds (unshare, no name under /run/netns). The kernel removes that namespace when the
process ends, however it ends (kill -9 included), and a veth pair goes with either of its ends: nothing is left
behind to clean up. A hand started again takes the same master interface name: it waits until the old pair is
gone. So a node configured with `ROBOBUS_ETHERCAT_IFNAME=<master-if>` sees its NIC vanish with the hand and come
back with the next one (the conformance rig, services/ethercat_loop/rig.py).

    python -m services.ethercat_loop.sim.veth_hand --master-if ecr1 [-- virtual_hand options, e.g. --garbage]

Two processes: this one (in the caller's namespace: makes the pair, forwards SIGTERM, exits with the hand's
status) and the hand (`--inner`: its own namespace; dies with this one, PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
HAND_IF = "hand0"
IFNAME_MAX = 15


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _no_ipv6(ifname: str) -> None:
    """No router solicitations or MLD reports on the EtherCAT link (/proc/sys/net is the caller's namespace's)."""
    try:
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1")
    except OSError:
        pass


def _inner(hand_if: str, ready_fd: int, go_fd: int, hand_args: list[str]) -> int:
    """The hand's process: a namespace of its own, then wait for the parent's veth end, then the hand."""
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the line above: do not outlive it
        return 1
    if libc.unshare(CLONE_NEWNET) != 0:
        print(f"veth_hand: unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}", file=sys.stderr, flush=True)
        return 1
    os.write(ready_fd, b"u")
    os.close(ready_fd)
    if os.read(go_fd, 1) != b"g":  # the parent gave up (EOF)
        return 1
    os.close(go_fd)
    _no_ipv6("all")
    _no_ipv6("default")
    for ifname in ("lo", hand_if):
        r = _ip("link", "set", ifname, "up")
        if r.returncode != 0:
            print(f"veth_hand: ip link set {ifname} up: {r.stderr.strip()}", file=sys.stderr, flush=True)
            return 1
    from services.ethercat_loop.sim.virtual_hand import main as hand_main  # late: numpy, the palm model

    return hand_main(["--iface", hand_if, *hand_args])


def _make_pair(master_if: str, hand_if: str, pid: int, timeout_s: float) -> str | None:
    """The veth pair, the master's end here and the hand's in the namespace of process `pid`; None, or why not.
    A name still taken is waited for: the pair of a hand that just ended goes with its namespace, which the
    kernel tears down asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = _ip("link", "add", master_if, "type", "veth", "peer", "name", hand_if, "netns", str(pid))
        if r.returncode == 0:
            break
        if "exists" not in r.stderr or time.monotonic() > deadline:
            return f"ip link add {master_if}: {r.stderr.strip()}"
        time.sleep(0.05)
    _no_ipv6(master_if)
    r = _ip("link", "set", master_if, "up")
    return None if r.returncode == 0 else f"ip link set {master_if} up: {r.stderr.strip()}"


def run(master_if: str, hand_args: list[str], timeout_s: float = 20.0) -> int:
    if not 0 < len(master_if) <= IFNAME_MAX:
        print(f"veth_hand: interface name {master_if!r}: 1 to {IFNAME_MAX} characters", file=sys.stderr)
        return 2
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-m", "services.ethercat_loop.sim.veth_hand", "--inner", "--ready-fd", str(ready_w),
         "--go-fd", str(go_r), "--", *hand_args],
        pass_fds=(ready_w, go_r), cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    os.close(ready_w)
    os.close(go_r)

    def forward(sig: int, _frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        if os.read(ready_r, 1) != b"u":
            return child.wait() or 1
        why = _make_pair(master_if, HAND_IF, child.pid, timeout_s)
        if why is not None:
            print(f"veth_hand: {why}", file=sys.stderr, flush=True)
            child.kill()
            child.wait()
            return 1
        os.write(go_w, b"g")
        print(f"veth_hand: the hand's process {child.pid} answers on the veth peer of {master_if}", flush=True)
        while True:
            try:
                return child.wait()
            except InterruptedError:
                continue
    finally:
        os.close(ready_r)
        os.close(go_w)
        if child.poll() is None:
            child.kill()
            child.wait()
        _ip("link", "del", master_if)  # gone already with the hand's namespace, unless the pair outlived it


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.ethercat_loop.sim.veth_hand",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--master-if", help="the master's end of the veth pair, made in this namespace")
    p.add_argument("--timeout", type=float, default=20.0, help="how long to wait for the name to be free")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--go-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("hand_args", nargs="*", help="virtual_hand options, after --")
    a, rest = p.parse_known_args(argv)
    hand_args = [x for x in (*a.hand_args, *rest) if x != "--"]
    if a.inner:
        return _inner(HAND_IF, a.ready_fd, a.go_fd, hand_args)
    if not a.master_if:
        p.error("--master-if is required")
    return run(a.master_if, hand_args, a.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
