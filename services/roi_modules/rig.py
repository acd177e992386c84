"""roi-modules on its simulator, each in its own process (shared/tools/simrig.py): what the conformance suite
(tests/conformance/) runs every fault against.

Two modules, a GPIO module (octet 10) and an ODrive (octet 20), configured as `make run` does so that they come up
operational, on a loopback /24 of the rig's own (127.198.<n>, n from the test process's id: the ROI ports are fixed,
so the address is what keeps this rig apart from other tests and other runs). The garbage device is the generic
peer (`python -m shared.tools.simrig garbage-udp`) on both ROI ports of both addresses; the device of the wrong kind is
the ROI simulator with the two module types swapped (a GPIO module at the ODrive's octet and the other way round).

`python -m services.roi_modules.rig garbage --prefix P --octets 10,20` runs those garbage peers in one process.
"""

from __future__ import annotations

import json
import os
import threading

from services.roi_modules import protocol as p
from shared.tools import simrig
from shared.tools.simrig import Footprint, Ports, RigCommand, SimRig

PREFIX = f"127.198.{os.getpid() % 250 + 1}"
OCTETS = (10, 20)
MODULES = [
    {"name": "io", "octet": 10, "type": "gpio", "pin_modes": {"3": "output"}},
    {"name": "wheel", "octet": 20, "type": "odrive", "initial_mode": "velocity"},
]


def _node_env(ports: Ports) -> dict[str, str]:
    return {"ROBOBUS_ROI_NETWORK": PREFIX, "ROBOBUS_ROI_HOST_OCTET": "100",
            "ROBOBUS_ROI_MODULES": json.dumps(MODULES)}


def _sim(kinds: str) -> list[str]:
    return ["-m", "services.roi_modules.sim", "--prefix", PREFIX, "--modules", kinds]


RIG = SimRig(
    node_module="services.roi_modules",
    devices=("io", "wheel"),
    liveness_s=1.0,  # RoiSettings.liveness_s: the default budget (README, "Health")
    sim=lambda ports: _sim("gpio:10,odrive:20"),
    node_env=_node_env,
    return_s=5.0,  # one probe period (1 s) + the probe's wait (0.55 s) + the settings' push, with room
    garbage_sim=lambda ports: ["-m", "services.roi_modules.rig", "garbage", "--prefix", PREFIX,
                               "--octets", ",".join(map(str, OCTETS))],
    wrong_kind_sim=lambda ports: _sim("odrive:10,gpio:20"),
    read_command=RigCommand("wheel", "ping"),
    footprint=Footprint(node_mb=45.0, total_mb=65.0, cpu_core=0.035),  # 3 modules polled
)


def garbage(prefix: str, octets: list[int]) -> None:
    """The generic garbage peer on both ROI ports of every module address: random bytes to every datagram."""
    peers = [threading.Thread(target=simrig.main, args=(["garbage-udp", "--host", f"{prefix}.{o}", "--port",
                                                          str(port)],), daemon=True)
             for o in octets for port in (p.GENERAL_PORT, p.SYSADMIN_PORT)]
    for t in peers:
        t.start()
    for t in peers:
        t.join()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m services.roi_modules.rig")
    ap.add_argument("kind", choices=["garbage"])
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--octets", default=",".join(map(str, OCTETS)))
    a = ap.parse_args(argv)
    try:
        garbage(a.prefix, [int(o) for o in a.octets.split(",") if o])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
