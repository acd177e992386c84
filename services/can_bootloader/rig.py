"""can-bootloader on simulated motor boards, each in its own process (shared/tools/simrig.py): what the conformance
suite (tests/conformance/) runs every fault against.

The bus is python-can's `udp_multicast` (the one python-can interface here that two processes share without a
kernel module: `virtual` is one process only, no vcan module, socketcand needs SocketCAN on its server), on an
IPv4 group and ports of the rig's own. The node serves bus 1 (boards 0-9, the simulator: `python -m
services.can_bootloader.sim --interface udp_multicast ...` on the same group and port) and bus 2 (no boards).

What the link is here (README, "Health"): the adapter. The boards answer only while in their bootloader and only
when asked, so between a flash and a read nothing on the bus is owed to the node, and what the transport can tell
is the adapter's own health. The faults that remove, stop or replace the boards on a bus that needs no peer are
therefore not link faults (below, `not_applicable`); the adapter failing is (tests/can_bootloader/test_link.py:
a bus that cannot open is unreachable and probed, one that fails under the node is lost and reopened, a board
answering garbage is counted and answered `device_error`).
"""

from __future__ import annotations

import json

from shared.tools.simrig import Footprint, Ports, RigCommand, SimRig

GROUP = "239.74.163.2"  # python-can's IPv4 default group; the port (per rig) keeps stacks apart
# the link is the adapter: on udp_multicast the node's own socket, healthy with or without peers
_ADAPTER = "the adapter (udp_multicast: no peer needed) stays healthy, and boards owe no frame unasked"


def _node_env(ports: Ports) -> dict[str, str]:
    bus1 = {"interface": "udp_multicast", "channel": GROUP, "options": {"port": ports["can"]}}
    bus2 = {"interface": "udp_multicast", "channel": GROUP, "options": {"port": ports["can2"]}}  # no boards on it
    return {"ROBOBUS_CAN_BUS1": json.dumps(bus1), "ROBOBUS_CAN_BUS2": json.dumps(bus2),
            "ROBOBUS_CAN_LIVENESS_S": "1.0"}


def _sim(ports: Ports) -> list[str]:
    return ["-m", "services.can_bootloader.sim", "--interface", "udp_multicast", "--channel", GROUP,
            "--port", str(ports["can"]), "--bus", "1", "--erase-s", "0.05"]


def _needs() -> str | None:
    """None when a udp_multicast bus opens here (python-can's msgpack extra, IPv4 multicast on loopback)."""
    try:
        import can

        from shared.tools.localbroker import free_port

        bus = can.Bus(interface="udp_multicast", channel=GROUP, port=free_port())
        bus.shutdown()
    except Exception as exc:
        return f"python-can's udp_multicast bus does not open here: {exc}"
    return None


RIG = SimRig(
    node_module="services.can_bootloader",
    devices=("motors",),
    liveness_s=1.0,
    sim=_sim,
    node_env=_node_env,
    return_s=5.0,
    read_command=RigCommand("motors", "read_version", {"board": 3}),
    not_applicable={
        "absent": f"{_ADAPTER}; read_version answers timeout. A bus that cannot open: unreachable, probed "
                  "(tests/can_bootloader/test_link.py)",
        "hang": f"{_ADAPTER}; read_version answers timeout. An adapter failing under the node: lost, reopened "
                "(test_link.py)",
        "vanish": f"{_ADAPTER}; read_version answers timeout. An adapter failing under the node: lost, reopened "
                  "(test_link.py)",
        "garbage": f"{_ADAPTER}; garbage on the bus is counted. A board answering garbage to a read: counted, "
                   "device_error (test_link.py)",
        "wrong_kind": "a CAN board identifies itself only when asked: another kind is silent to the bootloader's "
                      "commands (timeout) or malformed (device_error, counted)",
    },
    needs=_needs,
    footprint=Footprint(node_mb=45.0, total_mb=50.0, cpu_core=0.01),  # simulated boards in-process, idle
    stop_unmeasured="its one motion command resets a motor board: nothing keeps moving to stop; "
                    "tests/can_bootloader/test_stop.py holds it to the stop",
)
