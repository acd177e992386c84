"""The epuck-gateway on its WiFi simulator (one e-puck2 on TCP), each in its own process (shared/tools/simrig.py): what
the conformance suite (tests/conformance/) runs every fault against."""

from __future__ import annotations

import json

from services.epuck_gateway.sim.wifi import EpuckSimConfig
from services.epuck_gateway.transport.base import budget_s
from services.epuck_gateway.transport.wifi import EpuckLinkConfig
from shared.tools.simrig import Footprint, Ports, RigCommand, SimRig


def _robots(ports: Ports) -> dict[str, str]:
    return {"ROBOBUS_EPUCK_ROBOTS": json.dumps([{"id": "epuck1", "host": "127.0.0.1", "port": ports["epuck"]}])}


# The budget the gateway applies to a streaming robot (transport/liveness.py, transport/base.budget_s): the stale
# timeout plus the longest recent image interval, rounded up to 0.1 s. At the simulator's default 10 fps the intervals
# seen are a little above 0.1 s (timer overshoot), so 0.8 + 0.1+ rounds to 1.0 s. A robot without a link is
# unreachable after the stale timeout alone (0.8 s).
LIVENESS_S = budget_s(EpuckLinkConfig("").stale_timeout_s + 1.0 / EpuckSimConfig().image_fps + 0.01)

RIG = SimRig(
    node_module="services.epuck_gateway",
    devices=("epuck1",),
    liveness_s=LIVENESS_S,
    sim=lambda ports: ["-m", "services.epuck_gateway.sim", "--count", "1", "--base-port", str(ports["epuck"])],
    node_env=_robots,
    return_s=8.0,
    garbage_sim=lambda ports: ["-m", "shared.tools.simrig", "garbage-tcp", "--port", str(ports["epuck"])],
    read_command=RigCommand("epuck1", "stream", {"image": True, "sensors": True}),
    not_applicable={"wrong_kind": "the e-puck2's WiFi protocol has no identification: a device of another kind is "
                                  "garbage to it (implausible packets: see garbage)"},
    footprint=Footprint(node_mb=46.0, total_mb=90.0, cpu_core=0.08),  # 2 WiFi robots + 1 serial at 50 Hz
)
