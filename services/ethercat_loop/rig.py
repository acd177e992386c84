"""ethercat-loop on the virtual hand, each in its own process (shared/tools/simrig.py): what the conformance suite
(tests/conformance/) runs every fault against.

The device side is `sim/veth_hand.py`: the virtual hand (a software EtherCAT slave: the bridge, then the palm)
on a veth pair that exists only while it runs. The node's NIC is the master's end of that pair, named once per
rig instance (unique among the rigs and tests of this machine); the hand's end lives in a namespace only the
hand's process holds, so the pair is gone when the simulator ends, however it ends (kill -9 included), and a
restarted simulator makes it again under the same name. So in this rig the NIC vanishes with the hand (the
`vanish` fault) and comes back with it; the master notices a NIC that is not the one it opened and re-scans
(README, "Liveness budget").

Faults: absent (no hand: no NIC, no slave), vanish (kill -9: hand and NIC gone), hang (SIGSTOP: frames
unanswered), garbage (`--garbage`: every EtherCAT frame answered with a non-EtherCAT frame and random datagrams,
no slave), wrong kind (a 0230 palm where the node expects 0220), broker, node kill -9, SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

from services.ethercat_loop.settings import EthercatSettings
from shared.tools.simrig import Argv, Footprint, Ports, RigCommand, SimRig

_DEFAULTS = EthercatSettings()
HAND = ["-m", "services.ethercat_loop.sim.veth_hand"]
# the hand answers a little below the cycle's priority (80), as the wire tests run it: a hand at normal
# priority can be starved by the cycle polling SOEM's socket during bring-up (README, "Facts")
HAND_OPTS = ["--rt-priority", "60"]


def master_if(ports: Ports) -> str:
    """The node's NIC: unique per rig instance (this process, a port allocated for it), 15 characters at most."""
    return f"ec{os.getpid() % 100000}p{ports['ethercat-nic']}"


def _hand(*extra: str) -> Argv:
    return lambda ports: [*HAND, "--master-if", master_if(ports), "--", *HAND_OPTS, *extra]


def _node_env(ports: Ports) -> dict[str, str]:
    return {"ROBOBUS_ETHERCAT_BACKEND": "virtual", "ROBOBUS_ETHERCAT_IFNAME": master_if(ports),
            "ROBOBUS_ETHERCAT_EXPECT_PROTOCOL": "0220"}


def needs() -> str | None:
    """None when this machine can run the rig: root, iproute2, pysoem, a veth pair and a namespace of its own."""
    if os.geteuid() != 0:
        return "needs root (a veth pair, a network namespace, raw sockets)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    try:
        import pysoem  # noqa: F401
    except ImportError as exc:
        return f"needs pysoem: {exc}"
    name = f"rbq{os.getpid() % 1000000}"
    r = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}h"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a veth pair: {r.stderr.strip()}"
    with contextlib.suppress(OSError):
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    r = subprocess.run([sys.executable, "-c", "import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
                        "sys.exit(0 if libc.unshare(0x40000000) == 0 else os.strerror(ctypes.get_errno()))"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot unshare a network namespace: {r.stderr.strip()}"
    return None


RIG = SimRig(
    node_module="services.ethercat_loop",
    devices=(_DEFAULTS.ethercat_device,),
    liveness_s=_DEFAULTS.ethercat_liveness_s,  # 0.25 s: the motors' 20 ms cut-out + the service's reads (README)
    sim=_hand(),
    node_env=_node_env,
    # once unreachable the palm is probed once per probe period (5 s); a probe is a cycle process that starts,
    # scans the bus and brings the palm to OP (about a second here, more on a busy machine)
    return_s=_DEFAULTS.ethercat_probe_period_s + 5.0,
    garbage_sim=_hand("--garbage"),
    wrong_kind_sim=_hand("--protocol", "0230"),
    # no read-only command: the palm's state is published, not asked for. A zero demand to one motor is the
    # harmless command that must be answered (ok, or `unavailable` while the palm is not in OP)
    read_command=RigCommand(_DEFAULTS.ethercat_device, "set_demands", {"motors": {"0": 0}}),
    needs=needs,
    footprint=Footprint(node_mb=45.0, total_mb=50.0, cpu_core=0.08),  # the palm model's 1 kHz cycle, in-process
)
