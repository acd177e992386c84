"""The epuck-gateway on its WiFi simulator (one e-puck2 on TCP), each in its own process (shared/simrig.py): what
the conformance suite (tests/conformance/) runs every fault against."""

from __future__ import annotations

import json

from shared.simrig import Ports, RigCommand, SimRig


def _robots(ports: Ports) -> dict[str, str]:
    return {"ROBOBUS_EPUCK_ROBOTS": json.dumps([{"id": "epuck1", "host": "127.0.0.1", "port": ports["epuck"]}])}


RIG = SimRig(
    node_module="services.epuck_gateway",
    devices=("epuck1",),
    liveness_s=2.0,
    sim=lambda ports: ["-m", "services.epuck_gateway.sim", "--count", "1", "--base-port", str(ports["epuck"])],
    node_env=_robots,
    return_s=8.0,
    garbage_sim=lambda ports: ["-m", "shared.simrig", "garbage-tcp", "--port", str(ports["epuck"])],
    read_command=RigCommand("epuck1", "stream", {"image": True, "sensors": True}),
    not_applicable={"wrong_kind": "the e-puck2's WiFi protocol has no identification: another device is garbage "
                                  "to it (see garbage)"},
)
